"""Activation checkpointing and torch.compile, per transformer block.

Both wrap blocks *after* TP (so they see the sharded modules) and *before* FSDP (so FSDP's
all-gather hooks sit outside the recomputed region and run once, not twice).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

AC_MODES = ("none", "full", "selective")


def apply_ac(blocks: nn.ModuleDict | nn.ModuleList, mode: str, every: int = 2) -> None:
    """``full``: recompute every block's activations in backward (keeps only block inputs:
    about 2·s·b·h bytes per layer instead of tens of times that). ``selective``: only every
    ``every``-th block, trading part of the memory saving for less recomputation."""
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpoint mode {mode!r}; accepted: {', '.join(AC_MODES)}")
    if mode == "none":
        return
    for i, (key, block) in enumerate(_items(blocks)):
        if mode == "full" or i % every == 0:
            blocks[key] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(blocks: nn.ModuleDict | nn.ModuleList) -> None:
    """Compile each block separately: blocks are identical, so one graph is reused for all
    of them, and FSDP's per-block hooks stay outside the compiled regions."""
    for key, block in _items(blocks):
        blocks[key] = torch.compile(block, fullgraph=True)


def _items(blocks):
    return list(blocks.items()) if isinstance(blocks, nn.ModuleDict) else list(enumerate(blocks))
