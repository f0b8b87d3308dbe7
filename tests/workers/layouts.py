"""The command line a layout worker shares: OUT_DIR LAYOUT [LAYOUT ...], one torchrun start-up
training every layout in turn (tests/conftest.py's train_layouts reads the results)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.parallel import shutdown_distributed


def save_each_layout(run) -> None:
    """``run(layout) -> result`` for each layout named on the command line; rank 0 saves
    each result as OUT_DIR/LAYOUT.pt."""
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        result = run(name)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    shutdown_distributed()
