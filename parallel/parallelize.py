"""Compose tensor parallelism and FSDP2 on one model, in the order that works:
TP first (intra-node, turns weights into DTensors on the tp mesh), then activation
checkpointing and compile per block, then FSDP (shards those DTensors again over the
data-parallel mesh)."""

from __future__ import annotations


from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel.activation_checkpoint import apply_ac, apply_compile
from parallel.async_tp import async_tp_unavailable, enable_async_tp
from parallel.fsdp import apply_fsdp, fsdp_mesh, resolve_strategy
from parallel.mesh import check_tp_fits, submesh, with_one_rank_dp
from parallel.tensor_parallel import apply_tp
from parallel.wrap import modules_to_wrap


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sharding_strategy: str = "FULL_SHARD",
    mixed_precision: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    tp_plan: dict | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    fsdp_units: list | None = None,
    block_classes: tuple[type, ...] | None = None,
    min_num_params: int | None = None,
    activation_checkpoint: str = "none",
    ac_every: int = 2,
    compile: bool = False,
    async_tp: bool = False,
) -> nn.Module:
    """Apply TP (where the mesh has a tp dimension) and FSDP (where it has data parallelism,
    or where mixed precision / CPU offload need it: then over a one-rank dimension).
    ``sharding_strategy="auto"`` chooses by the mesh (see `resolve_strategy`). For a
    pipeline, call it on each stage module with the whole mesh.

    The model says how: ``model.tp_plan(...)`` and ``model.fsdp_units()`` if it defines them;
    otherwise pass ``tp_plan`` and either ``fsdp_units``, ``block_classes`` (transformer
    auto-wrap) or ``min_num_params`` (size-based wrap). Works on a meta-device model:
    nothing is allocated until ``init_weights`` / ``to_empty``. Activation checkpointing
    and compile wrap the blocks in ``model.transformer_blocks()`` (a ModuleDict/ModuleList).
    ``async_tp`` overlaps TP collectives with matmuls inside the compiled blocks (CUDA,
    ``compile=True`` and a tp dimension; see parallel/async_tp.py).
    """
    if (mixed_precision is not None or cpu_offload) and submesh(mesh, "dp") is None:
        # No data parallelism (one process, or TP / PP alone): FSDP over a data-parallel
        # dimension of one rank communicates nothing, but it is what keeps fp32 master
        # weights while computing in bf16 (or offloads to the CPU).
        mesh = with_one_rank_dp(mesh)
    tp_mesh = submesh(mesh, "tp")
    if async_tp:
        reason = async_tp_unavailable(mesh.device_type, compile=compile,
                                      tp=tp_mesh.size() if tp_mesh is not None else 1)
        if reason:
            raise ValueError(f"async_tp: {reason}")
    if tp_mesh is not None:
        if hasattr(model, "tp_divisible"):
            check_tp_fits(tp_mesh.size(), model.tp_divisible())
        plan = tp_plan if tp_plan is not None else _model_tp_plan(model, sequence_parallel, loss_parallel)
        apply_tp(model, tp_mesh, plan)
        if async_tp:
            enable_async_tp(tp_mesh)

    if activation_checkpoint != "none" or compile:
        if not hasattr(model, "transformer_blocks"):
            raise ValueError(f"{type(model).__name__} has no transformer_blocks(); activation "
                             "checkpointing and compile need the container of blocks")
        apply_ac(model.transformer_blocks(), activation_checkpoint, ac_every)
        if compile:
            apply_compile(model.transformer_blocks())

    sharding_strategy = resolve_strategy(sharding_strategy, mesh)
    dp_mesh = fsdp_mesh(mesh, sharding_strategy)
    if dp_mesh is None and (mixed_precision is not None or cpu_offload):
        dp_mesh = mesh["dp_shard"]  # the one-rank dimension made above
    if dp_mesh is None:
        return model
    if fsdp_units is None:
        if block_classes is not None or min_num_params is not None:
            fsdp_units = modules_to_wrap(model, block_classes=block_classes, min_num_params=min_num_params)
        elif hasattr(model, "fsdp_units"):
            fsdp_units = model.fsdp_units()
        else:
            raise ValueError(f"{type(model).__name__} has no fsdp_units(); pass fsdp_units, "
                             "block_classes or min_num_params")
    return apply_fsdp(model, dp_mesh, fsdp_units, strategy=sharding_strategy,
                      mp_policy=mixed_precision, cpu_offload=cpu_offload)


def _model_tp_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    if not hasattr(model, "tp_plan"):
        raise ValueError(f"{type(model).__name__} has no tp_plan(); pass tp_plan= "
                         "(module-name pattern -> ParallelStyle)")
    return model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
