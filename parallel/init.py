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
from torch.distributed.tensor import DTensor, distribute_tensor

# Names that wrappers (activation checkpointing, torch.compile) insert into parameter
# names; dropping them keeps the seed of a parameter the same with or without them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

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
    local shards are allocated."""
    if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        module.to_empty(device=device or default_device())


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
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the full value, so slice locally
        # instead of scattering from rank 0.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)
