"""Train the debug Llama with float8 Linear layers (torchao) under a parallel layout, as
tests/workers/parity.py does without float8, and record losses, gradient norms, weights,
the collectives of the first step (torch's CommDebugMode) and what FSDP all-gathers:

    torchrun --nproc-per-node 4 tests/workers/float8_parity.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

from torch.distributed.tensor.debug import CommDebugMode

from meshtrain.models import registry
from meshtrain.parallel import ParallelDims, parallelize, submesh
from meshtrain.parallel.float8 import apply_float8, precompute_float8_scales
from meshtrain.training.step import train_step
from tests.workers.layouts import save_each_layout
from tests.workers.parity import BATCH, MAX_NORM, batches, build, full_weights, optimizer_and_schedule

STEPS = 2  # the check is the first step (same weights); the second shows the layout keeps training

# name -> (ParallelDims kwargs, float8 recipe, FSDP float8 all-gather); "fp32_..." runs without float8.
LAYOUTS = {
    "tensorwise_dp2_tp2": (dict(dp_shard=2, tp=2), "tensorwise", False),
    "allgather_dp2_tp2": (dict(dp_shard=2, tp=2), "tensorwise", True),
    "allgather_fsdp4": (dict(dp_shard=4), "tensorwise", True),
    "rowwise_dp2_tp2": (dict(dp_shard=2, tp=2), "rowwise", False),
    "fp32_dp2_tp2": (dict(dp_shard=2, tp=2), None, False),
}


def run(layout: str) -> dict:
    dims, recipe, all_gather = LAYOUTS[layout]
    model = build({})
    if recipe is not None:
        apply_float8(model, skip=registry.get("llama").high_precision, recipe=recipe,
                     fsdp_float8_all_gather=all_gather)
    mesh = ParallelDims(**dims).build_mesh()
    model = parallelize(model, mesh, sharding_strategy="FULL_SHARD")
    dp_mesh, tp_mesh = submesh(mesh, "dp"), submesh(mesh, "tp")
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    model.init_weights(seed=0)
    result = {"init": full_weights(model), "losses": [], "grad_norms": [], "styles": sorted(
        {type(hook).__qualname__ for m in model.modules() for hook in getattr(m, "_forward_pre_hooks", {}).values()
         if "Float8" in type(hook).__qualname__})}
    optimizer, scheduler = optimizer_and_schedule([model])
    per_rank = BATCH // dp_size
    for n, tokens in enumerate(batches(model.cfg.vocab_size)[:STEPS]):
        local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        if all_gather:  # as training/recipe.py's with_float8_scales does
            precompute_float8_scales([model])
        with CommDebugMode() as comm:
            loss, norm = train_step(model, optimizer, [(local[:, :-1], local[:, 1:])], max_norm=MAX_NORM,
                                    loss_parallel=tp_mesh is not None, dp_mesh=dp_mesh)
        if n == 0:
            result["collectives"] = {str(k): v for k, v in comm.get_comm_counts().items()}
            result["all_gather_dtypes"] = all_gather_dtypes(model)
        scheduler.step()
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
    result["final"] = full_weights(model)
    return result


def all_gather_dtypes(model) -> dict[str, str]:
    """What FSDP all-gathers for each block-layer weight (parameter name -> dtype), read off
    FSDP's own parameter records."""
    from torch.distributed.fsdp import FSDPModule

    dtypes = {}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fp in group.fsdp_params if group else []:
            dtypes[fp._param_fqn] = str(fp.all_gather_inputs[0].dtype)
    return dtypes


if __name__ == "__main__":
    save_each_layout(run)
