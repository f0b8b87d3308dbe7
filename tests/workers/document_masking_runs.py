"""Packed sft runs with document masking in several layouts, one torchrun job: for each
`train.py` command line, the validation loss at the initial weights (training/evaluate.py,
before any step) and one training step's loss and full gradients:

    torchrun --nproc-per-node 4 tests/workers/document_masking_runs.py OUT_DIR RUNS.json

RUNS.json maps a run name to its train.py arguments; results go to OUT_DIR/NAME.pt, with
how validation cuts the batch (``units``: the (dp rank, micro-batch, pipeline micro-batch)
pieces whose means it averages; ``cp``: the pieces each sequence is split into), which
the reference in tests/test_document_masking.py needs to average alike. [validation]
does not take sft data yet, so the validation runs over the training loader's batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.parallel import mesh_coordinate, shutdown_distributed, submesh
from meshtrain.training.evaluate import Validation
from tests.workers.recipe_runs import build_run, full_weights


def run(argv: list[str]) -> dict:
    cfg, model, layout, mesh, parts, data, optimizer, scheduler, step = build_run(argv)
    _, dp = mesh_coordinate(mesh, "dp")
    cp = submesh(mesh, "cp").size() if submesh(mesh, "cp") is not None else 1
    per_rank = len(data.batch(0)) * (layout.pp_microbatches if layout.pipelined else 1)
    validation = Validation(cfg, layout, parts, torch.device("cpu"))
    # [validation] takes no sft data yet: its loader (a stand-in text file) is swapped for
    # the training one, so evaluate.py's loss runs over step 0's packed sequences.
    validation.data = data
    result = validation.run(0)  # the initial weights
    result["loss"], _ = step(data.batch(0), 1)
    drop = {alias for names in model.tied_weights() for alias in names[1:]}
    result["grads"] = full_weights(parts.modules, submesh(mesh, "pp"), drop, grads=True)
    return {**result, "units": dp * per_rank, "cp": cp}


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for name, argv in runs.items():
        result = run(argv)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    shutdown_distributed()
