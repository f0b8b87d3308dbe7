"""Layout-independent initialization.

DTensor's own random ops on CPU give each layout different numbers, so a TP x FSDP run
would start from other weights than a single-process run and nothing could be compared.
Instead every parameter's *full* value is a pure function of (seed, parameter name):
each rank generates that full tensor with a generator seeded from the pair, keeps the
slice its placements say it owns, and drops the rest. Peak extra memory is one full
parameter (the largest, e.g. the embedding), never the model; there is no communication.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Names that wrappers (activation checkpointing, torch.compile) insert into parameter
# names; dropping them keeps the seed of a parameter the same with or without them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.",
                    "base_layer.")  # a LoRA-wrapped Linear's own weight (parallel/lora.py)

InitFn = Callable[[torch.Tensor, torch.Generator], object]


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name). Python's hash() is salted per process."""
    return (seed * 1_000_003 + zlib.crc32(canonical_name(name).encode())) % (2**63)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(module: nn.Module, device: torch.device | str | None = None) -> None:
    """Allocate (uninitialized) storage for a module built on meta. Under FSDP/TP only the
    local shards are allocated. Tied parameters stay tied (to_empty gives each module
    its own new tensor when it swaps DTensors or crosses devices)."""
    if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        tied = tied_parameter_names(module)
        module.to_empty(device=device or default_device())
        retie(module, tied)


def tied_parameter_names(module: nn.Module) -> list[list[str]]:
    """Groups of names that share one Parameter (a tied embedding and output layer)."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(module: nn.Module, tied: list[list[str]]) -> None:
    """Point every name of each group back at the first name's Parameter."""
    for names in tied:
        source = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, source)


@torch.no_grad()
def init_param_(param: torch.Tensor, seed: int, name: str, init_fn: InitFn) -> None:
    """Fill ``param`` — a plain tensor or a DTensor with any placements — with its slice of
    the full tensor that ``init_fn(full, generator)`` produces from (seed, name)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    # Generate on the parameter's device so GPUs do it fast; values depend on the device
    # type (CPU and CUDA generators differ) but never on the layout.
    generator = torch.Generator(device=local.device).manual_seed(param_seed(seed, name))
    full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
    init_fn(full, generator)
    copy_block_(param, full, name)


@torch.no_grad()
def copy_block_(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Copy into ``param`` (a plain tensor or a DTensor with any placements) its block of
    the full tensor ``full``."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if isinstance(param, DTensor):
        # The rank's shard is a block of the full tensor (the same arithmetic DCP uses to
        # place shards in a checkpoint): copy from a view of it, no intermediate copies.
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the block "
                               f"{tuple(shape)} its placements {param.placements} describe")
        for dim, (start, size) in enumerate(zip(offset, shape)):
            full = full.narrow(dim, start, size)
    local.copy_(full)


def trunc_normal_(t: torch.Tensor, std: float, generator: torch.Generator, bound: float = 3.0) -> torch.Tensor:
    """N(0, std) truncated to +-bound*std, in place. torch's own trunc_normal_ resamples
    through full-size temporaries (3-4x the tensor); this redraws only the rejected values,
    so a full 70B embedding can be initialized with one byte per element of overhead."""
    t.normal_(0.0, std, generator=generator)
    limit = bound * std
    while True:
        # Two comparisons instead of t.abs() (a full-size float temporary), and
        # count_nonzero instead of sum() (which would widen the mask to int64).
        rejected = t.gt(limit).logical_or_(t.lt(-limit))
        count = int(torch.count_nonzero(rejected))
        if count == 0:
            return t
        t[rejected] = torch.empty(count, dtype=t.dtype, device=t.device).normal_(0.0, std, generator=generator)
