"""Expert loads: how many token copies each MoE layer's router sent each expert during a
step, summed over the data-parallel ranks, and the moe/ scalars made of them
(docs/moe.md). Shared by the native family (models/moe/) and transformers' routed
experts (models/hf/experts.py), so both count and report the same way."""

from __future__ import annotations

import torch
import torch.distributed as dist


def counts_this_forward(x: torch.Tensor) -> bool:
    """Whether a forward over ``x`` is one of the step's own, to count: False in evaluation
    (no gradient), while autograd's engine runs (activation checkpointing recomputing the
    block in backward), during a pipeline stage's metadata inference (a forward before the
    schedule's own, on whatever tensors), and on fake or meta tensors (the dry run): their
    routing counts for nothing."""
    from torch._subclasses.fake_tensor import is_fake

    from meshtrain.parallel.pipeline import inferring_stage_metadata

    if torch.compiler.is_compiling():
        # A compiled block recomputes inside its backward graph, which replays no buffer
        # update; its tracing tensors are fake, and the autograd engine's state cannot be
        # traced: only evaluation and shape inference are left out.
        return torch.is_grad_enabled() and not inferring_stage_metadata()
    return (torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            and not inferring_stage_metadata() and not x.is_meta and not is_fake(x))


def summed_loads(per_layer: list[torch.Tensor], sum_over=()) -> torch.Tensor:
    """[layers, experts] of the counts ``per_layer`` (this rank's), summed over the meshes
    ``sum_over`` (each data-parallel rank routed its own tokens; tp ranks route the same
    ones, so tp is never among them), as float64."""
    loads = torch.stack(per_layer)
    for mesh in sum_over:
        if mesh is not None:
            dist.all_reduce(loads, group=mesh.get_group())
    return loads.double()


def load_scalars(names: list[str], loads: torch.Tensor) -> dict[str, float]:
    """moe/load_max_over_mean/layer{name}: the busiest expert's tokens over the mean per
    expert, per layer (1 = perfectly even)."""
    ratio = (loads.max(dim=-1).values / loads.mean(dim=-1).clamp(min=1)).tolist()
    return {f"moe/load_max_over_mean/layer{name}": r for name, r in zip(names, ratio)}
