"""FSDP2 (`fully_shard`) under the sharding-strategy names FSDP1 and DeepSpeed users know.

| strategy            | ZeRO | shards params over    | re-gathers in backward |
|---------------------|------|-----------------------|------------------------|
| FULL_SHARD          | 3    | dp_shard              | yes                    |
| SHARD_GRAD_OP       | 2    | dp_shard              | no: kept from forward  |
| NO_SHARD            | DDP  | nothing (replicas)    | n/a                    |
| HYBRID_SHARD        | 3    | dp_shard, x dp_repl.  | yes                    |
| HYBRID_SHARD_ZERO2  | 2    | dp_shard, x dp_repl.  | no                     |

Under FSDP2 even "ZeRO-2" keeps the optimizer state and gradients sharded; the strategy
only decides whether the gathered parameters are freed after forward (FULL_SHARD: save
memory, pay a second all-gather in backward) or kept until backward (SHARD_GRAD_OP).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from meshtrain.parallel.mesh import LayoutError, submesh
from meshtrain.parallel.vocabulary import STRATEGIES

# FSDP2 warns whenever a unit returns a view (a TP-sharded embedding does) because an
# in-place op on it would skip a backward hook. Our models only combine activations
# out of place (h = x + f(x)), so the warning is noise on every step.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def mixed_precision_policy(param_dtype: str = "bfloat16", reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """Compute in ``param_dtype`` (the sharded fp32 master weights are cast when gathered),
    reduce gradients in ``reduce_dtype``."""
    for value in (param_dtype, reduce_dtype):
        if value not in _DTYPES:
            raise ValueError(f"unknown dtype {value!r}; accepted: {', '.join(_DTYPES)}")
    return MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])


def resolve_strategy(strategy: str, mesh: DeviceMesh) -> str:
    """``"auto"`` picks for the mesh: under a pipeline SHARD_GRAD_OP, because each stage runs
    forward once per micro-batch and FULL_SHARD would re-gather its parameters every time;
    otherwise FULL_SHARD. With both dp_replicate and dp_shard > 1, the HYBRID_SHARD form
    of either; with dp_replicate alone, NO_SHARD (plain replicas)."""
    if strategy != "auto":
        return strategy
    zero2 = submesh(mesh, "pp") is not None
    if submesh(mesh, "dp_replicate") is not None and submesh(mesh, "dp_shard_cp") is not None:
        return "HYBRID_SHARD_ZERO2" if zero2 else "HYBRID_SHARD"
    if submesh(mesh, "dp_replicate") is not None:
        return "NO_SHARD"
    return "SHARD_GRAD_OP" if zero2 else "FULL_SHARD"


def fsdp_mesh(mesh: DeviceMesh, strategy: str) -> DeviceMesh | None:
    """The data-parallel mesh FSDP works over for ``strategy``; None when there is no data
    parallelism. A 2-D mesh means HSDP: replicate over dim 0, shard over dim 1."""
    if strategy not in STRATEGIES:
        raise LayoutError(f"unknown sharding_strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")
    # Context-parallel ranks hold the same weights: FSDP shards over dp_shard x cp.
    replicate, shard = submesh(mesh, "dp_replicate"), submesh(mesh, "dp_shard_cp")
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        if replicate is not None:
            raise LayoutError(
                f"dp_replicate={replicate.size()} asks for replicas, which {strategy} does not make: "
                "use HYBRID_SHARD / HYBRID_SHARD_ZERO2, or set dp_replicate=1"
            )
        return shard
    if strategy.startswith("HYBRID"):
        if replicate is None or shard is None:
            raise LayoutError(
                f"{strategy} shards within dp_shard and replicates across dp_replicate, so both must "
                f"be > 1 (got dp_replicate={replicate.size() if replicate else 1}, "
                f"dp_shard={shard.size() if shard else 1}); use FULL_SHARD or NO_SHARD instead"
            )
        return mesh["dp_replicate", shard.mesh_dim_names[0]]
    dp = submesh(mesh, "dp_cp")
    if dp is None:
        return None
    # NO_SHARD: every data-parallel rank is a replica = HSDP with a shard group of one.
    # Gradients are all-reduced; each rank keeps full parameters and optimizer state.
    return dp._unflatten(0, (dp.size(), 1), ("dp_noshard_replicate", "dp_noshard_shard"))


def check_strategy(strategy: str, degrees: dict[str, int]) -> str:
    """`resolve_strategy` and `fsdp_mesh`'s rules on the degrees alone (``{"pp": 2,
    "dp_shard": 4, ...}``), before any process group exists: the resolved strategy, or a
    LayoutError. train.py and the planner refuse exactly what `parallelize` would."""
    mesh = _Degrees(degrees)
    resolved = resolve_strategy(strategy, mesh)
    fsdp_mesh(mesh, resolved)
    return resolved


class _Degrees:
    """Just enough of a DeviceMesh for the rules above: dimension names and sizes, with
    degree-1 dimensions left out as ParallelDims.build_mesh leaves them out."""

    def __init__(self, sizes: dict[str, int], flattened: dict[str, int] | None = None):
        self.sizes = {name: size for name, size in sizes.items() if size > 1}
        self.mesh_dim_names = tuple(self.sizes)
        self.flattened = {} if flattened is None else flattened  # shared, as a mesh's are

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else names
        return _Degrees({n: self.sizes[n] if n in self.sizes else self.flattened[n] for n in names}, self.flattened)

    def size(self) -> int:
        return math.prod(self.sizes.values())

    def _flatten(self, name=None):
        self.flattened[name or "flat"] = self.size()
        return _Degrees({name or "flat": self.size()}, self.flattened)

    def _unflatten(self, dim, shape, names):
        return _Degrees(dict(zip(names, shape)))


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, units: list, *, strategy: str = "FULL_SHARD",
               mp_policy: MixedPrecisionPolicy | None = None, cpu_offload: bool = False,
               expert_units: tuple[list, DeviceMesh] | None = None) -> nn.Module:
    """`fully_shard` each unit (a module, or a list of modules gathered together) bottom-up,
    then the root, which holds whatever no unit claimed. ``expert_units``: (modules already
    split over expert parallelism, the mesh of the ranks holding the same experts), sharded
    first over that mesh (parallel/expert_parallel.py)."""
    reshard = STRATEGIES[strategy] == 3  # ZeRO-3: free the gathered parameters after forward
    kwargs = dict(mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                  if cpu_offload else OffloadPolicy())
    for experts in (expert_units[0] if expert_units else []):
        fully_shard(experts, **{**kwargs, "mesh": expert_units[1]}, reshard_after_forward=reshard)
        # Each expert's gradient already sums the tokens of every data-parallel rank (the
        # all-to-all brought them); it is reduced over the fewer ranks holding that expert,
        # but must be divided like every other gradient, by the whole data-parallel size.
        experts.set_gradient_divide_factor(float(dp_mesh.size()))
        if dp_mesh.device_type == "cpu" and expert_units[1].size() > 1:
            # gloo has no pre-multiplied sum: a plain sum, then divide. (Not over one rank:
            # torch 2.13 then divides twice.)
            experts.set_force_sum_reduction_for_comms(True)
    for i, unit in enumerate(units):
        # The last unit to run forward is the first needed in backward: freeing its
        # parameters only to gather them again at once would waste an all-gather.
        last = i == len(units) - 1
        fully_shard(unit, reshard_after_forward=reshard and not last, **kwargs)
        if _only_embeddings(unit, model) and hasattr(unit, "set_unshard_in_backward"):
            # An embedding's backward needs the token ids, not its weight: gathering the
            # table again in backward (1 GiB in bf16 for Llama 3 8B) would buy nothing.
            unit.set_unshard_in_backward(False)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def hold_gradients(model: nn.Module, hold: bool) -> None:
    """For gradient accumulation that reduces once a step ([parallelism] gradient_sync =
    "step"): with ``hold``, the next backward neither reduces nor reshards -- each unit keeps
    its gathered weights and adds its gradient into an unsharded fp32 sum (FSDP2 accumulates
    in the reduce dtype) -- as torch's PipelineStage runs every backward of a step but the
    last; without, the next backward reduce-scatters the sums and reshards, as usual. The
    saving: one reduction a step instead of one a micro-batch, and, for units that keep
    their weights from forward to backward (SHARD_GRAD_OP, NO_SHARD), one gather. The cost:
    2 + 4 bytes per parameter this rank holds unsharded, between micro-batches. A model
    without FSDP is left alone."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(not hold)
            module.set_reshard_after_backward(not hold, recurse=False)
            module.set_requires_gradient_sync(not hold, recurse=False)


def _only_embeddings(unit, model: nn.Module) -> bool:
    """True when ``unit`` holds nothing but nn.Embedding tables that no other module
    shares (a tied output layer does need the weight in backward)."""
    modules = unit if isinstance(unit, (list, tuple)) else [unit]
    if not modules or not all(isinstance(m, nn.Embedding) for m in modules):
        return False
    inside = {id(p) for m in modules for p in m.parameters()}
    return not any(id(p) in inside for name, mod in model.named_modules() if not any(mod is m for m in modules)
                   for p in mod.parameters(recurse=False))
