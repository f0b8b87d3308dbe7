"""meshtrain.parallel: compose FSDP2, tensor parallelism and pipelining over one DeviceMesh.

    from meshtrain.parallel import ParallelDims, parallelize
    mesh = ParallelDims(dp_shard=-1, tp=2).build_mesh()
    model = parallelize(model, mesh, sharding_strategy="FULL_SHARD")

With pipeline stages: `split_into_stages` cuts the meta model, `parallelize` each stage,
`build_schedule` runs them (see parallel/pipeline.py); `tie_across_stages` keeps a weight
tied between the first and last stage (parallel/tied.py).

Knows no model: a model brings its TP plan (`tp_plan()`) and FSDP units (`fsdp_units()`),
or the caller passes them.

The names below are imported on first use (PEP 562), not with the package: the config
reads parallel/vocabulary.py before torch is imported, and importing a submodule runs
this file.
"""

import importlib

# submodule -> the names it gives the package
_EXPORTS = {
    "activation_checkpoint": ("apply_ac", "apply_compile"),
    "fsdp": ("apply_fsdp", "fsdp_mesh", "hold_gradients", "mixed_precision_policy", "resolve_strategy"),
    "grad_clip": ("clip_grad_norm_",),
    "init": ("init_param_", "materialize"),
    "layout": ("ParallelDims",),
    "mesh": ("LayoutError", "check_tp_fits", "default_device_type", "init_distributed", "mesh_coordinate",
             "shutdown_distributed", "submesh"),
    "compose": ("parallelize",),
    "pipeline": ("build_schedule", "check_pipeline", "split_into_stages", "split_layers", "stage_ids"),
    "tensor_parallel": ("apply_tp", "loss_parallel_context"),
    "tied": ("TiedWeights", "tie_across_stages"),
    "vocabulary": ("AC_MODES", "DIM_NAMES", "GRADIENT_SYNC", "SCHEDULES", "STRATEGIES"),
    "wrap": ("modules_to_wrap",),
}
_SUBMODULE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_SUBMODULE)


def __getattr__(name: str):
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULE))
