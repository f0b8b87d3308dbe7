"""Expert parallelism: the routed experts split over ``ep`` ranks, tokens sent to the rank
holding their expert and brought back, with two all-to-alls of variable sizes per layer.

The ep ranks are borrowed from the data-parallel shard dimension (torchtitan's and
Megatron's layout): dp_shard is viewed as (dp_shard / ep) x ep, ep varying fastest, so an
ep group is ep neighbouring FSDP ranks. Each ep rank holds n_experts / ep whole experts
(a Shard(0) DTensor on the ep mesh) and runs them over the tokens every rank of its group
routed to them. FSDP then shards the non-expert weights over the whole dp_shard group as
before, and each expert weight over what ep leaves (the "dp_shard_mod_ep" dimension);
both meshes come from one root, so FSDP sees an expert weight as a 2-D DTensor.

A module is expert-parallel when its forward is ``forward(x_sorted, tokens_per_expert)``
(rows of ``x_sorted`` grouped by expert, expert 0's first) returning one row per input
row, and its weights have the experts as their leading dimension: the model names them
(``model.expert_modules()``), this file knows no model.

Dispatch and combine, for one ep group of P ranks holding L = E / P experts each:

    x_sorted (grouped by expert)   --all-to-all, splits = tokens for each rank's experts-->
    received (grouped by source rank, then local expert)  --permute-->  grouped by local
    expert  --> experts -->  permute back  --all-to-all, the splits reversed-->  out, in
    x_sorted's order
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshtrain.parallel.mesh import LayoutError, submesh

# The dimensions dp_shard becomes: FSDP shards expert weights over the first, ep splits them over the second.
EXPERT_DIMS = ("dp_shard_mod_ep", "ep")


def check_ep_fits(ep: int, *, dp_shard: int, divisible: dict[str, int] | None, dp_replicate: int = 1,
                  cp: int = 1) -> list[str]:
    """The problems of ``ep`` against the other degrees and the model (``divisible``: what
    ep splits, e.g. {"routed experts": 64}; None: the model has no experts); [] if none."""
    if ep == 1:
        return []
    if divisible is None:
        return [f"ep={ep} splits routed experts, and this model has none it can split (expert_modules()); use ep = 1"]
    problems = [f"ep={ep} does not divide the {what} ({size}): {size} % {ep} = {size % ep}"
                for what, size in divisible.items() if size % ep]
    if dp_shard % ep:
        problems.append(f"ep={ep} borrows its ranks from dp_shard={dp_shard}, which it must divide "
                        f"({dp_shard} % {ep} = {dp_shard % ep})")
    if dp_replicate > 1:
        problems.append(f"ep={ep} with dp_replicate={dp_replicate} (HSDP) is not supported yet; use "
                        "dp_replicate = 1")
    if cp > 1:
        problems.append(f"ep={ep} with cp={cp} is not supported yet; use cp = 1")
    return problems


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """``mesh`` with its dp_shard dimension viewed as ("dp_shard_mod_ep", "ep") = (dp_shard /
    ep, ep). The same ranks, one root: the FSDP mesh of the experts and their ep mesh
    compose with the tp mesh. Made once per mesh (new process groups, on every rank)."""
    cached = getattr(mesh, "_meshtrain_expert_mesh", None)
    if cached is not None and cached[0] == ep:
        return cached[1]
    names = mesh.mesh_dim_names or ()
    dp_shard = submesh(mesh, "dp_shard")
    size = dp_shard.size() if dp_shard is not None else 1
    if "dp_shard" not in names or size % ep:
        raise LayoutError(f"ep={ep} borrows its ranks from dp_shard={size}, which it must divide")
    out = mesh._unflatten(names.index("dp_shard"), (size // ep, ep), EXPERT_DIMS)
    mesh._meshtrain_expert_mesh = (ep, out)
    return out


def made_expert_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The expert mesh `expert_mesh` made from ``mesh``, None if none was (ep = 1)."""
    cached = getattr(mesh, "_meshtrain_expert_mesh", None)
    return cached[1] if cached is not None else None


class ExpertParallel(ParallelStyle):
    """Split a module's weights by their leading (expert) dimension over the ep mesh and
    wrap its forward with the dispatch and combine all-to-alls. ``device_mesh``: the ep
    mesh, or ("ep", "tp") when the experts are replicated over tensor-parallel ranks (each
    tp rank routes the same tokens and exchanges them with its own ep group)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _shard_by_expert, input_fn=self._dispatch,
                                 output_fn=self._combine)

    def _dispatch(self, module, inputs, device_mesh):
        x_sorted, tokens_per_expert = inputs
        ep_mesh = _ep_of(device_mesh)
        P = ep_mesh.size()
        if _shape_only(x_sorted):
            # Meta or fake tensors (the dry run): the group sizes are data. Routing is taken to
            # be even -- each rank sends every peer 1/P of its rows and receives as many -- so
            # the traced step holds both all-to-alls at their even-routing size.
            module._ep_state = None if x_sorted.is_meta or x_sorted.shape[0] % P else "even"
            if module._ep_state == "even":
                all_to_all_single(tokens_per_expert, None, None, ep_mesh)  # the counts, as a real step sends them
                x_sorted = all_to_all_single_autograd(x_sorted, None, None, ep_mesh)
            return x_sorted, tokens_per_expert.view(P, -1).sum(dim=0)
        # Every rank learns how many rows each peer sends to each of its experts.
        received = all_to_all_single(tokens_per_expert, None, None, ep_mesh).wait().view(P, -1)
        send_splits = tokens_per_expert.view(P, -1).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        x = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, ep_mesh)
        # Rows arrive grouped by source rank, then by local expert; the experts want them
        # grouped by expert (all ranks' rows for local expert 0 first).
        segment = torch.repeat_interleave(torch.arange(received.numel(), device=x.device), received.flatten())
        local_expert, source = segment % received.shape[1], segment // received.shape[1]
        order = torch.argsort(local_expert * P + source, stable=True)
        module._ep_state = (order, send_splits, recv_splits)
        return x[order], received.sum(dim=0)

    def _combine(self, module, out, device_mesh):
        state, module._ep_state = module._ep_state, None
        if state is None:
            return out
        if state == "even":
            return all_to_all_single_autograd(out, None, None, _ep_of(device_mesh))
        order, send_splits, recv_splits = state
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(out[back], send_splits, recv_splits, _ep_of(device_mesh))


def _shape_only(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


def _ep_of(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["ep"] if mesh.ndim > 1 else mesh


def _shard_by_expert(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Each parameter a DTensor split by experts over ep (and replicated over tp)."""
    placements = [Shard(0) if n == "ep" else Replicate() for n in mesh.mesh_dim_names]
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, placements),
                                                    requires_grad=param.requires_grad))


def apply_ep(model: nn.Module, mesh: DeviceMesh, ep: int) -> list[nn.Module]:
    """Split ``model.expert_modules()`` over ep (before TP and FSDP); returns them."""
    experts = list(model.expert_modules().values())
    ex = expert_mesh(mesh, ep)
    target = ex["ep", "tp"] if "tp" in (ex.mesh_dim_names or ()) and ex["tp"].size() > 1 else ex["ep"]
    for module in experts:
        ExpertParallel()._apply(module, target)
    return experts
