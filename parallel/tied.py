"""Tied weights across pipeline stages.

A model whose output layer reuses its token embedding (GPT-2, Llama 3.2 1B) has the two
ends of the network on the first and the last stage. As Megatron-LM does, each of those
stages keeps its own copy of the weight, initialized identically; after every backward
the copies' gradients are summed, so each copy receives the gradient of the one shared
weight and the identical optimizer updates keep them equal bit for bit.

The sum runs over a small process group of just the pipeline ranks holding a copy, one
group per position in the rest of the mesh (same dp and tp coordinate, so the copies'
local shards are the same block of the weight). With V-shaped schedules the first and
last stage sit on the same rank and the sum needs no communication at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtrain.parallel.init import canonical_name


@dataclass
class TiedWeights:
    """This rank's copies of each tied weight and the group to sum their gradients over."""
    copies: list[list[nn.Parameter]]
    groups: list[dist.ProcessGroup | None]
    # Copies other than the first name's: clipped, but left out of the gradient norm,
    # which must count the shared weight once.
    duplicates: list[nn.Parameter]

    @torch.no_grad()
    def sum_gradients(self) -> None:
        for params, group in zip(self.copies, self.groups):
            if not all(p.requires_grad for p in params):
                continue  # frozen (the base of a LoRA run): no gradient to share
            for p in params:
                if p.grad is None:  # unused this step: still take part in the sum
                    p.grad = torch.zeros_like(p)
                # Without FSDP a TP gradient may come out in another placement than its
                # weight's (an embedding's is replicated); the copies must agree block by block.
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [_local(p.grad) for p in params]
            if not grads:
                continue
            total = grads[0].clone() if len(grads) > 1 else grads[0]
            for g in grads[1:]:
                total += g
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                if g is not total:
                    g.copy_(total)


def tie_across_stages(parts: list[nn.Module], mesh: DeviceMesh, pp_mesh: DeviceMesh,
                      ties: list[tuple[str, ...]]) -> TiedWeights:
    """Collective over the whole world (it creates process groups): call it on every rank
    after the stages are parallelized. ``ties``: groups of parameter names that are one
    weight, the first counted in the gradient norm (``model.tied_weights()``)."""
    if mesh.size() != dist.get_world_size() or (mesh.mesh_dim_names or ())[:1] != ("pp",):
        raise ValueError("tie_across_stages needs the whole world's mesh with pp as its first "
                         f"dimension (got {mesh})")
    if not ties:
        return TiedWeights([], [], [])
    named = {canonical_name(n): p for part in parts for n, p in part.named_parameters()}
    mine = [[named[n] for n in names if n in named] for names in ties]
    holding = [bool(params) for params in mine]
    everyone: list = [None] * pp_mesh.size()
    dist.all_gather_object(everyone, holding, group=pp_mesh.get_group())

    # mesh.mesh is [pp, rest...]: column c lists the pipeline ranks at one position of
    # the rest of the mesh. Every rank creates every group, as new_group requires.
    columns = mesh.mesh.reshape(pp_mesh.size(), -1).T.tolist()
    groups = []
    for t in range(len(ties)):
        holders = [r for r in range(pp_mesh.size()) if everyone[r][t]]
        if len(holders) < 2:
            groups.append(None)
            continue
        if len(holders) == pp_mesh.size():  # every pipeline rank (pp = 2): the pp group is it
            groups.append(pp_mesh.get_group())
            continue
        mine_group, _ = dist.new_subgroups_by_enumeration([[col[r] for r in holders] for col in columns])
        groups.append(mine_group if pp_mesh.get_local_rank() in holders else None)
    duplicates = [named[n] for names in ties for n in names[1:] if n in named]
    return TiedWeights(mine, groups, duplicates)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
