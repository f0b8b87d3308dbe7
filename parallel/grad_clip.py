"""Gradient clipping by the true global norm.

With FSDP and TP each rank holds a slice of every gradient, so a per-rank norm is wrong.
Each rank sums |g|^p over its local shards, weighting an element that is replicated over
k ranks by 1/k so the sum over the mesh counts it once; one all-reduce over all ranks of
the mesh then gives every rank the same total. (Reducing a DTensor norm dim by dim would
work too, but with one all-reduce per mesh dimension, whose different reduction orders
can leave ranks with clip factors a rounding error apart.) Pipeline stages hold different
parameters, so their totals are summed over `pp_mesh`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, *, norm_type: float = 2.0,
                    pp_mesh: DeviceMesh | None = None, not_in_norm=()) -> torch.Tensor:
    """Clip in place (when ``max_norm > 0``) and return the global gradient norm.
    ``not_in_norm``: parameters that are clipped but not counted, such as the second copy
    of a weight tied across pipeline stages."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    skip = {id(p) for p in not_in_norm}
    counted = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
    inf = norm_type == float("inf")
    # (mesh, replication factor) -> local tensors; None mesh = plain tensors.
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in counted:
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
            copies = math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())
            groups.setdefault((g.device_mesh, copies), []).append(g.to_local())
        else:
            groups.setdefault((None, 1), []).append(g)

    per_mesh: dict[object, torch.Tensor] = {}
    for (mesh, copies), tensors in groups.items():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type, foreach=True)
        value = norm if inf else norm ** norm_type / copies
        prev = per_mesh.get(mesh)
        per_mesh[mesh] = value if prev is None else (torch.maximum(prev, value) if inf else prev + value)

    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device)
    for mesh, value in per_mesh.items():
        if mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=_whole_group(mesh))
        total = torch.maximum(total, value) if inf else total + value
    if pp_mesh is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pp_mesh.get_group())
    total = total if inf else total ** (1.0 / norm_type)

    if max_norm > 0:
        # torch.nn.utils.clip_grads_with_norm_'s arithmetic, on the local shards: every
        # rank holds the same total, so scaling each shard scales the whole gradient.
        # Local tensors also keep the multiply in place where a DTensor foreach op may
        # not be (under fake tensors it allocates a copy of every gradient).
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in local:  # foreach kernels need one device per call (CPU offload: all on CPU)
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            torch._foreach_mul_(group, coef.to(device))
    return total


def _whole_group(mesh: DeviceMesh):
    """One process group over every rank of ``mesh`` (created once, then cached by torch)."""
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
