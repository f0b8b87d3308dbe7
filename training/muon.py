"""Muon on sharded matrices: torch.optim.Muon's update, with each whole matrix
orthogonalised on one rank of its shard group.

Which parameters: Muon takes the 2-D hidden weights -- every 2-D parameter that is not in
an ``nn.Embedding`` and not the output layer (the family's ``output_layer``,
models/registry.py). Embeddings, the output layer, norms, biases and 3-D expert weights
stay with AdamW: the split of Keller Jordan's Muon and of Moonlight, and what
torch.optim.Muon's own documentation asks for.

Why a distribution at all: Newton-Schulz needs the whole matrix, and under FSDP2 / HSDP /
TP each rank holds a shard (run alone on a shard it is a different, wrong update). The
momentum is elementwise, so it stays on the shards; only the orthogonalisation moves.

How (the Moonlight / Kimi design, written with DTensor's redistribute): the matrices of
one shape and layout -- the same projection of every layer -- are stacked into one
[k, rows, cols] DTensor, sharded like its matrices one dimension further in, and
redistributed to Shard(0) on every mesh dimension that shards them: one all-to-all after
which each of the W ranks of the shard group holds k/W whole matrices (k padded with zero
matrices to a multiple of W). Each rank orthogonalises its own, and the reverse all-to-all
returns the results to the shards. The work is spread evenly over the shard group; on a
replicated mesh dimension (HSDP's dp_replicate) each replica does its own group's, the same
way each replica already runs its own AdamW step.

Cost per step, per rank: two all-to-alls of its shard of the hidden matrices in bf16
(torch's Newton-Schulz casts to bf16 first, so moving bf16 gives the same bits), i.e.
2 x 2 bytes x (W-1)/W x (its shard's hidden parameters). Memory: the momentum (4 bytes
per hidden parameter, sharded, in the checkpoint) instead of AdamW's 8, and, transiently
during the step, the bf16 updates of its shards (2 bytes per hidden parameter), the
stacked shards and owned whole matrices of one shape group (2 x 2 bytes x its share)
and Newton-Schulz's bf16 temporaries of one matrix.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


def hidden_matrices(model: nn.Module, output_layer: str) -> list[nn.Parameter]:
    """The parameters Muon updates: trainable, 2-D, not an embedding's, not the output
    layer's (a module named ``output_layer``, or ending in ".<output_layer>" inside a
    wrapper). A weight tied between the embedding and the output is neither."""
    left_out = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name == output_layer or name.endswith("." + output_layer):
            left_out.update(id(p) for p in module.parameters())
    return [p for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in left_out]


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose parameters may be DTensors sharded any way FSDP2 and TP
    shard them; on plain tensors it computes what torch.optim.Muon computes."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            momentum, lr = group["momentum"], group["lr"]
            updates = []
            for grad, buf in zip(grads, bufs):  # torch's momentum, elementwise: on the shards
                buf.lerp_(grad, 1 - momentum)
                # bf16 now: Newton-Schulz casts to it first anyway (the same bits), and the
                # updates of every matrix are held until they are orthogonalised.
                updates.append((grad.lerp(buf, momentum) if group["nesterov"] else buf).bfloat16())

            def newton_schulz(matrix):
                return _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

            for param, update in zip(params, orthogonalise(updates, newton_schulz)):
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def orthogonalise(updates: list[torch.Tensor], newton_schulz) -> list[torch.Tensor]:
    """``newton_schulz`` of each whole matrix, returned laid out like its input."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    groups = defaultdict(list)
    for i, u in enumerate(updates):
        if isinstance(u, DTensor) and not all(p.is_replicate() for p in u.placements):
            assert not any(p.is_partial() for p in u.placements), f"an unreduced gradient: {u.placements}"
            groups[(tuple(u.shape), u.device_mesh, tuple(u.placements))].append(i)
        elif isinstance(u, DTensor):  # replicated: every rank holds it whole (NO_SHARD, pp alone)
            out[i] = DTensor.from_local(newton_schulz(u.to_local()), u.device_mesh, u.placements, run_check=False)
        else:
            out[i] = newton_schulz(u)
    for ids in groups.values():
        for i, result in zip(ids, _orthogonalise_group([updates[i] for i in ids], newton_schulz)):
            out[i] = result
    return out


def _orthogonalise_group(updates: list[DTensor], newton_schulz) -> list[DTensor]:
    """Matrices of one shape and layout: stack, all-to-all so each rank of the shard group
    holds whole matrices, orthogonalise those, all-to-all back (the module docstring)."""
    first = updates[0]
    mesh, placements, shape = first.device_mesh, tuple(first.placements), tuple(first.shape)
    owners = math.prod(mesh.size(d) for d, p in enumerate(placements) if not p.is_replicate())
    local = [u.to_local() for u in updates]
    local += [torch.zeros_like(local[0])] * (-len(local) % owners)  # Newton-Schulz of zeros is zeros
    stacked_shape = (len(local), *shape)
    stacked = DTensor.from_local(torch.stack(local), mesh, [_one_dim_in(p) for p in placements], run_check=False,
                                 shape=stacked_shape, stride=_contiguous_stride(stacked_shape))
    owned = stacked.redistribute(mesh, _owner_placements(mesh, placements))
    mine = owned.to_local()
    done = torch.stack([newton_schulz(m) for m in mine]) if len(mine) else mine
    back = DTensor.from_local(done, mesh, owned.placements, run_check=False, shape=stacked_shape,
                              stride=_contiguous_stride(stacked_shape)).redistribute(mesh, stacked.placements)
    return [DTensor.from_local(m, mesh, placements, run_check=False, shape=first.shape, stride=first.stride())
            for m in back.to_local().unbind(0)[:len(updates)]]


def _owner_placements(mesh, placements) -> list:
    """Where the stack goes: split over its matrices (dim 0) on every mesh dimension that
    shards them, so each rank holds whole matrices, chosen so that DTensor's plan is one
    all-to-all per mesh dimension. Shard(0) on each does that when the matrices' shards
    nest on one tensor dimension (FSDP over TP's rows: _StridedShard, Shard). FSDP on rows
    over TP on columns (a row-wise TP layer) needs the outer split strided by the inner
    size: with plain Shard(0) twice DTensor would all-gather the TP dimension first."""
    target = [p if p.is_replicate() else Shard(0) for p in placements]
    sharding = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if len(sharding) == 2 and placements[sharding[0]].dim != placements[sharding[1]].dim:
        target[sharding[0]] = _StridedShard(0, split_factor=mesh.size(sharding[1]))
    return target


def _one_dim_in(placement):
    """A matrix's placement as the placement of a stack of such matrices (dim 0 new)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + 1)
    assert isinstance(placement, Replicate), placement
    return placement


def _contiguous_stride(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
