"""Compose tensor parallelism and FSDP2 on one model, in the order that works:
TP first (intra-node, turns weights into DTensors on the tp mesh), then activation
checkpointing and compile per block, then FSDP (shards those DTensors again over the
data-parallel mesh)."""

from __future__ import annotations


from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from meshtrain.parallel.activation_checkpoint import apply_ac, apply_compile
from meshtrain.parallel.async_tp import async_tp_unavailable, enable_async_tp
from meshtrain.parallel.context_parallel import apply_cp
from meshtrain.parallel.expert_parallel import apply_ep, check_ep_fits, expert_mesh
from meshtrain.parallel.fsdp import apply_fsdp, fsdp_mesh, resolve_strategy
from meshtrain.parallel.float8 import float8_tp_plan
from meshtrain.parallel.lora import lora_tp_plan
from meshtrain.parallel.mesh import LayoutError, check_tp_fits, submesh, with_one_rank_dp
from meshtrain.parallel.tensor_parallel import apply_tp
from meshtrain.parallel.wrap import modules_to_wrap


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
    blocks: list | nn.ModuleList | nn.ModuleDict | None = None,
    activation_checkpoint: str = "none",
    ac_every: int = 2,
    compile: bool = False,
    async_tp: bool = False,
    ep: int = 1,
) -> nn.Module:
    """Apply TP (where the mesh has a tp dimension) and FSDP (where it has data parallelism,
    or where mixed precision / CPU offload need it: then over a one-rank dimension).
    ``sharding_strategy="auto"`` chooses by the mesh (see `resolve_strategy`). For a
    pipeline, call it on each stage module with the whole mesh.

    The model says how: ``model.tp_plan(...)`` and ``model.fsdp_units()`` if it defines them;
    otherwise pass ``tp_plan`` and either ``fsdp_units``, ``block_classes`` (transformer
    auto-wrap) or ``min_num_params`` (size-based wrap). Works on a meta-device model:
    nothing is allocated until ``init_weights`` / ``to_empty``.

    ``tp_plan`` keys are module paths relative to ``model``, with ``*`` wildcards per dotted
    segment ("model.layers.*.self_attn.q_proj"). A key that matches no module, or a
    Colwise/RowwiseParallel style on a module that is not an nn.Linear / nn.Embedding, is
    refused with a `LayoutError` before anything is sharded.

    Activation checkpointing and compile wrap each transformer block: ``blocks`` (the
    block modules, or their ModuleList / ModuleDict), else ``model.transformer_blocks()``,
    else the instances of ``block_classes``. Each wrapper replaces its block in the
    block's parent, and FSDP shards the wrapper; parameter names gain
    ``_checkpoint_wrapped_module.`` / ``_orig_mod.`` (`parallel.init.canonical_name`
    drops them).

    ``async_tp`` overlaps TP collectives with matmuls inside the compiled blocks (CUDA,
    ``compile=True`` and a tp dimension; see parallel/async_tp.py).

    ``ep`` > 1 splits ``model.expert_modules()`` over ep ranks borrowed from dp_shard and
    shards their weights over the dp_shard / ep ranks left (parallel/expert_parallel.py).
    """
    if (mixed_precision is not None or cpu_offload) and submesh(mesh, "dp_cp") is None:
        # No data parallelism (one process, or TP / PP alone): FSDP over a data-parallel
        # dimension of one rank communicates nothing, but it is what keeps fp32 master
        # weights while computing in bf16 (or offloads to the CPU).
        mesh = with_one_rank_dp(mesh)
    experts = []
    if ep > 1:  # first: TP then leaves the expert weights (already DTensors) alone
        divisible = model.ep_divisible() if hasattr(model, "expert_modules") else None
        problems = check_ep_fits(ep, dp_shard=_size(mesh, "dp_shard"), divisible=divisible,
                                 dp_replicate=_size(mesh, "dp_replicate"), cp=_size(mesh, "cp"))
        if problems:
            raise LayoutError("; ".join(problems))
        experts = apply_ep(model, mesh, ep)
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
        # LoRA adapters follow their base layers; tensorwise float8 layers gather in float8
        apply_tp(model, tp_mesh, float8_tp_plan(model, lora_tp_plan(model, plan), tp_mesh.device_type))
        if async_tp:
            enable_async_tp(tp_mesh)
    if submesh(mesh, "cp") is not None:  # attention exchanges heads for sequence over cp
        apply_cp(model, submesh(mesh, "cp"))

    if fsdp_units is None and (block_classes is not None or min_num_params is not None):
        # Found before activation checkpointing and compile wrap the blocks (the wrappers
        # are not instances of the block class), then swapped for their wrappers below.
        fsdp_units = modules_to_wrap(model, block_classes=block_classes, min_num_params=min_num_params)

    if activation_checkpoint != "none" or compile:
        found = _blocks(model, blocks, block_classes)
        if compile and tp_mesh is not None and activation_checkpoint in ("full", "selective"):
            # Compiling a checkpointed block whose recomputation reruns TP's collectives
            # fails in torch 2.13's AOTAutograd (it saves the DTensors' DeviceMesh among the
            # tensors for backward; "op" mode, which saves the collectives' outputs, and TP 1
            # compile fine). So the block is compiled and the compiled block checkpointed:
            # backward reruns the compiled forward; the same activations are kept.
            wrapped = apply_ac(apply_compile(found, root=model), activation_checkpoint, ac_every, root=model)
        else:
            wrapped = apply_ac(found, activation_checkpoint, ac_every, root=model)
            if compile:
                wrapped = apply_compile(wrapped, root=model)
        # FSDP must shard the outermost wrapper: its all-gather then runs once, before
        # the recomputed region, and its hooks stay outside the compiled graph.
        if fsdp_units is not None:
            fsdp_units = _swap(fsdp_units, dict(zip(map(id, found), wrapped)))

    sharding_strategy = resolve_strategy(sharding_strategy, mesh)
    dp_mesh = fsdp_mesh(mesh, sharding_strategy)
    if dp_mesh is None and (mixed_precision is not None or cpu_offload):
        dp_mesh = mesh["dp_shard"]  # the one-rank dimension made above
    if dp_mesh is None:
        return model
    if fsdp_units is None:
        if hasattr(model, "fsdp_units"):
            fsdp_units = model.fsdp_units()
        else:
            raise ValueError(f"{type(model).__name__} has no fsdp_units(); pass fsdp_units, "
                             "block_classes or min_num_params")
    if experts and dp_mesh.mesh_dim_names != ("dp_shard",):
        raise LayoutError(f"ep={ep} needs FSDP over dp_shard alone; sharding_strategy {sharding_strategy} "
                          "is not supported with it: use FULL_SHARD or SHARD_GRAD_OP")
    expert_units = (experts, expert_mesh(mesh, ep)["dp_shard_mod_ep"]) if experts else None
    return apply_fsdp(model, dp_mesh, fsdp_units, strategy=sharding_strategy,
                      mp_policy=mixed_precision, cpu_offload=cpu_offload, expert_units=expert_units)


def _size(mesh: DeviceMesh, name: str) -> int:
    sub = submesh(mesh, name)
    return sub.size() if sub is not None else 1


def _blocks(model: nn.Module, blocks, block_classes) -> list[nn.Module]:
    """The transformer blocks that activation checkpointing and compile wrap one by one:
    ``blocks`` if given (the modules, or their ModuleList / ModuleDict), else the model's
    ``transformer_blocks()``, else the instances of ``block_classes`` (the FSDP units of
    transformer auto-wrap; a block nested in another is wrapped with its outer block)."""
    if blocks is None and hasattr(model, "transformer_blocks"):
        blocks = model.transformer_blocks()
    if blocks is None and block_classes is not None:
        found = {id(m) for m in modules_to_wrap(model, block_classes=block_classes)}
        inner = {id(sub) for m in model.modules() if id(m) in found for sub in m.modules() if sub is not m}
        return [m for m in model.modules() if id(m) in found and id(m) not in inner]
    if blocks is None:
        raise ValueError(f"activation checkpointing and compile wrap each transformer block, and "
                         f"{type(model).__name__} does not say which they are: pass blocks= (the block "
                         "modules or their ModuleList) or block_classes=, or give the model a "
                         "transformer_blocks() method")
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks)


def _swap(units: list, wrappers: dict) -> list:
    """FSDP units with each wrapped block replaced by its wrapper (``wrappers``: id of the
    block -> wrapper); a unit may be one module or a list of modules sharded together."""
    swap = lambda m: wrappers.get(id(m), m)
    return [[swap(m) for m in u] if isinstance(u, (list, tuple)) else swap(u) for u in units]


def _model_tp_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    if not hasattr(model, "tp_plan"):
        raise ValueError(f"{type(model).__name__} has no tp_plan(); pass tp_plan= "
                         "(module-name pattern -> ParallelStyle)")
    return model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
