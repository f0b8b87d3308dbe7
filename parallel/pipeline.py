"""Pipeline parallelism: cut a model into stages, place them on the pp ranks, run them
with a schedule from `torch.distributed.pipelining`.

    layers = split_layers(n_layers=30, n_stages=4)        # [[0..6], [7..14], [15..22], [23..29]]
    parts  = split_into_stages(model, pp_mesh, layers, style="loop")
    for stage_index, part in parts: parallelize(part, mesh, ...)   # TP + FSDP per stage
    schedule = build_schedule("1F1B", parts, pp_mesh, n_microbatches=8, loss_fn=..., device=...)

A stage is the model itself with the layers of other stages deleted (and the embeddings
only on the first stage, the head only on the last), cut from the meta model so no rank
ever allocates another stage's weights. Parameter names stay those of the whole model,
so initialization and checkpoints do not depend on the cut.

Placement. With v stages per rank there are pp*v stages. Looped schedules put stage s
on rank s % pp (rank 0 holds 0, pp, 2pp, ...); V-shaped ones (ZBVZeroBubble,
DualPipeV) go down and back up, so with v=2 rank r holds stages r and 2pp-1-r and the
first and last stage sit on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.parallel.mesh import LayoutError
from meshtrain.parallel.vocabulary import SCHEDULES

def check_pipeline(*, pp: int, n_layers: int, schedule: str, stages_per_rank: int,
                   n_microbatches: int, local_batch: int, layers_per_stage: int = 0,
                   split_points: list[int] | tuple[int, ...] = ()) -> list[list[int]]:
    """Every rule a pipeline layout must satisfy, checked without a process group.
    Returns the layers of each stage; raises LayoutError naming what to change."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}")
    per_rank = SCHEDULES[schedule][0]
    if per_rank == "one" and stages_per_rank != 1:
        raise LayoutError(f"{schedule} runs one stage per rank, but pp_stages_per_rank = {stages_per_rank}; "
                          f"use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble for virtual stages")
    if isinstance(per_rank, int) and stages_per_rank != per_rank:
        raise LayoutError(f"{schedule} needs exactly {per_rank} stages per rank (a V shape), "
                          f"but pp_stages_per_rank = {stages_per_rank}")
    n_stages = pp * stages_per_rank
    stages = split_layers(n_layers, n_stages, layers_per_stage=layers_per_stage, split_points=split_points)
    if len(stages) != n_stages:
        raise LayoutError(f"the split gives {len(stages)} stages, but pp * pp_stages_per_rank = "
                          f"{pp} * {stages_per_rank} = {n_stages}")
    m = n_microbatches
    if local_batch % m:
        raise LayoutError(f"pp_microbatches = {m} must divide the sequences each pipeline runs per "
                          f"forward (local batch {local_batch})")
    if schedule in ("1F1B", "DualPipeV") and m < n_stages:
        raise LayoutError(f"{schedule} needs at least as many micro-batches as stages: "
                          f"pp_microbatches = {m} < {n_stages} stages (GPipe runs it)")
    if per_rank == "any" and stages_per_rank > 1:
        rounds = max(1, m // pp)
        if m % rounds:
            raise LayoutError(f"{schedule} runs micro-batches in rounds of pp = {pp}: pp_microbatches = {m} "
                              f"must be a multiple of {rounds} (or at most pp)")
    return stages


def split_layers(n_layers: int, n_stages: int, *, layers_per_stage: int = 0,
                 split_points: list[int] | tuple[int, ...] = ()) -> list[list[int]]:
    """Layer indices of each stage; every layer exactly once, in order.

    Default: as even as possible, the extra layers going to the middle stages, because
    the first stage also runs the embedding and the last one the output layer and loss.
    ``layers_per_stage``: that many per stage (the last takes the rest). ``split_points``:
    the first layer of every stage after the first, e.g. [8, 16, 24] for 4 stages.
    """
    if layers_per_stage and split_points:
        raise LayoutError("give pp_layers_per_stage or pp_split_points, not both")
    if layers_per_stage:
        split_points = list(range(layers_per_stage, n_layers, layers_per_stage))
    if split_points:
        points = list(split_points)
        if points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n_layers:
            raise LayoutError(f"pp_split_points = {points} must be increasing layer indices "
                              f"between 1 and {n_layers - 1} (the model has {n_layers} layers)")
        bounds = [0, *points, n_layers]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    if n_stages > n_layers:
        raise LayoutError(f"{n_stages} pipeline stages for {n_layers} layers: every stage needs at "
                          f"least one layer; lower pp or pp_stages_per_rank")
    base, extra = divmod(n_layers, n_stages)
    # Stages ordered middle-out receive the `extra` layers.
    middle_first = sorted(range(n_stages), key=lambda s: (abs(2 * s - (n_stages - 1)), s))
    sizes = [base + (s in middle_first[:extra]) for s in range(n_stages)]
    bounds = [sum(sizes[:s]) for s in range(n_stages + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def stage_ids(pp_rank: int, pp_size: int, n_stages: int, style: str = "loop") -> list[int]:
    """The stages that rank ``pp_rank`` of the pipeline runs, in order."""
    per_rank = n_stages // pp_size
    if style == "loop":
        return [pp_rank + i * pp_size for i in range(per_rank)]
    if style == "v":  # down on even passes, back up on odd ones
        return [i * pp_size + (pp_rank if i % 2 == 0 else pp_size - 1 - pp_rank) for i in range(per_rank)]
    raise ValueError(f"unknown stage placement style {style!r}; accepted: loop, v")


def split_into_stages(model: nn.Module, pp_mesh: DeviceMesh, stage_layers: list[list[int]], *,
                      style: str = "loop",
                      make_stage: Callable[..., nn.Module] | None = None) -> list[tuple[int, nn.Module]]:
    """(stage index, module) for each stage this rank runs.

    ``make_stage(layer_ids, first=..., last=...)`` builds one stage; by default the
    model's own ``pipeline_stage`` method. Call it on the meta model: cutting copies it.
    """
    make_stage = make_stage or getattr(model, "pipeline_stage", None)
    if make_stage is None:
        raise ValueError(f"{type(model).__name__} has no pipeline_stage(layer_ids, first, last); "
                         "pass make_stage=")
    n = len(stage_layers)
    if n % pp_mesh.size():
        raise LayoutError(f"{n} stages do not divide evenly over pp = {pp_mesh.size()} ranks")
    ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), n, style)
    return [(s, make_stage(stage_layers[s], first=s == 0, last=s == n - 1)) for s in ids]


def build_schedule(name: str, parts: list[tuple[int, nn.Module]], pp_mesh: DeviceMesh, *,
                   n_microbatches: int, n_stages: int, loss_fn: Callable, device: torch.device):
    """A `torch.distributed.pipelining` schedule over this rank's stage modules.

    ``loss_fn(output, target)`` runs on the last stage for each micro-batch and must
    already be scaled for the whole step: gradients are not rescaled here (scale_grads
    is off), so a mean loss divides by the number of micro-batches itself.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    try:
        cls = get_schedule_class(name)
    except ValueError:
        raise LayoutError(f"pipeline schedule {name!r} is not in this torch ({torch.__version__})") from None
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, index, n_stages, device, group=group) for index, module in parts]
    for stage in stages:
        _flag_metadata_inference(stage)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# ---- torch's metadata inference, told apart from training

# A plain flag, not a ContextVar: torch.compile traces the read of a module's attribute (and
# guards on it), where ContextVar.get would break the graph. A schedule runs on one thread.
_INFERRING = [False]


def inferring_stage_metadata() -> bool:
    """True while a pipeline stage runs torch's metadata inference: on a schedule's first
    step, before its own micro-batches, each stage runs a real forward and backward -- of
    the first micro-batch on the first stage, of uninitialized tensors of the right shape
    on the others -- to learn the shapes it sends. A model that keeps statistics of what
    it sees (a mixture of experts counting its experts' loads) leaves these out."""
    return _INFERRING[0]


def _flag_metadata_inference(stage) -> None:
    """Run ``stage``'s metadata inference (torch's private methods, where this torch has
    them) with `inferring_stage_metadata` true."""
    for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
        method = getattr(stage, name, None)
        if method is None:
            continue

        def flagged(*args, _method=method, **kwargs):
            before, _INFERRING[0] = _INFERRING[0], True
            try:
                return _method(*args, **kwargs)
            finally:
                _INFERRING[0] = before
        setattr(stage, name, flagged)
