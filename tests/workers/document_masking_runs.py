"""Packed sft runs with document masking in several layouts, one torchrun job: for each
`train.py` command line, the validation loss at the initial weights (training/evaluate.py,
before any step, over the same records with the same seed: step 0's packed sequences)
and one training step's loss and full gradients:

    torchrun --nproc-per-node 4 tests/workers/document_masking_runs.py OUT_DIR RUNS.json

RUNS.json maps a run name to its train.py arguments; results go to OUT_DIR/NAME.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.parallel import shutdown_distributed, submesh
from meshtrain.training.evaluate import Validation
from tests.workers.recipe_runs import build_run, full_weights


def run(argv: list[str]) -> dict:
    cfg, model, layout, mesh, parts, data, optimizer, scheduler, step = build_run(argv)
    result = Validation(cfg, layout, parts, torch.device("cpu")).run(0)  # the initial weights
    result["loss"], _ = step(data.batch(0), 1)
    drop = {alias for names in model.tied_weights() for alias in names[1:]}
    result["grads"] = full_weights(parts.modules, submesh(mesh, "pp"), drop, grads=True)
    return result


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for name, argv in runs.items():
        result = run(argv)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    shutdown_distributed()
