"""Packed sft runs with document masking in several layouts, one torchrun job: for each
`train.py` command line, the validation loss at the initial weights (training/evaluate.py,
before any step, over the same records with the same seed: step 0's packed sequences)
and one training step's loss and full gradients:

    torchrun --nproc-per-node 4 tests/workers/document_masking_runs.py OUT_DIR RUNS.json

RUNS.json maps a run name to its train.py arguments; results go to OUT_DIR/NAME.pt.
"""

from __future__ import annotations

import torch

from meshtrain.parallel import submesh
from meshtrain.training.evaluate import Validation
from tests.workers.recipe_runs import build_run, full_weights, run_each


def run(argv: list[str]) -> dict:
    cfg, model, layout, mesh, parts, data, optimizer, scheduler, step = build_run(argv)
    result = Validation(cfg, layout, parts, torch.device("cpu")).run(0)  # the initial weights
    result["loss"], _ = step(data.batch(0), 1)
    drop = {alias for names in model.tied_weights() for alias in names[1:]}
    result["grads"] = full_weights(parts.modules, submesh(mesh, "pp"), drop, grads=True)
    return result


if __name__ == "__main__":
    run_each(run)
