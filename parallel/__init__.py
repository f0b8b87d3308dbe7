"""meshtrain.parallel: compose FSDP2, tensor parallelism and pipelining over one DeviceMesh.

    from meshtrain.parallel import ParallelDims, parallelize
    mesh = ParallelDims(dp_shard=-1, tp=2).build_mesh()
    model = parallelize(model, mesh, sharding_strategy="FULL_SHARD")

With pipeline stages: `split_into_stages` cuts the meta model, `parallelize` each stage,
`build_schedule` runs them (see parallel/pipeline.py); `tie_across_stages` keeps a weight
tied between the first and last stage (parallel/tied.py).

Knows no model: a model brings its TP plan (`tp_plan()`) and FSDP units (`fsdp_units()`),
or the caller passes them.
"""

from meshtrain.parallel.activation_checkpoint import AC_MODES, apply_ac, apply_compile
from meshtrain.parallel.fsdp import STRATEGIES, apply_fsdp, fsdp_mesh, mixed_precision_policy, resolve_strategy
from meshtrain.parallel.grad_clip import clip_grad_norm_
from meshtrain.parallel.init import init_param_, materialize
from meshtrain.parallel.mesh import (
    DIM_NAMES,
    LayoutError,
    ParallelDims,
    check_tp_fits,
    default_device_type,
    init_distributed,
    mesh_coordinate,
    shutdown_distributed,
    submesh,
)
from meshtrain.parallel.parallelize import parallelize
from meshtrain.parallel.pipeline import SCHEDULES, build_schedule, check_pipeline, split_into_stages, split_layers, stage_ids
from meshtrain.parallel.tensor_parallel import apply_tp, loss_parallel_context
from meshtrain.parallel.tied import TiedWeights, tie_across_stages
from meshtrain.parallel.wrap import modules_to_wrap

__all__ = [
    "AC_MODES", "apply_ac", "apply_compile", "DIM_NAMES", "STRATEGIES", "LayoutError", "ParallelDims", "apply_fsdp", "apply_tp",
    "check_tp_fits", "clip_grad_norm_", "default_device_type", "fsdp_mesh", "init_distributed",
    "init_param_", "loss_parallel_context", "materialize", "mesh_coordinate",
    "mixed_precision_policy", "modules_to_wrap", "parallelize", "shutdown_distributed", "submesh",
    "SCHEDULES", "build_schedule", "check_pipeline", "resolve_strategy", "split_into_stages", "split_layers",
    "stage_ids", "TiedWeights", "tie_across_stages",
]
