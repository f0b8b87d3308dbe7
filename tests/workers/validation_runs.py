"""Train several `train.py` command lines a few steps in one torchrun job -- evaluating
between steps as train.py does when [validation] enable is on -- then evaluate each with
training/evaluate.py, and record the losses, gradient norms, the validation loss and the
full weights it was computed from (the references in tests/test_validation.py -- plain
PyTorch for pretraining data, transformers' own models for fine-tuning records --
recompute it):

    torchrun --nproc-per-node 4 tests/workers/validation_runs.py OUT_DIR RUNS.json

RUNS.json maps a run name to its train.py arguments; results go to OUT_DIR/NAME.pt.
"""

from __future__ import annotations

import torch

from meshtrain.parallel import submesh
from meshtrain.training.evaluate import Validation
from tests.workers.recipe_runs import build_run, full_weights, run_each


def run(argv: list[str]) -> dict:
    cfg, model, layout, mesh, parts, data, optimizer, scheduler, step = build_run(argv)
    t = cfg.training
    validation = Validation(cfg, layout, parts, torch.device("cpu"))
    result = {"losses": [], "grad_norms": []}
    for n in range(1, t.steps + 1):  # trained away from the initial weights first
        loss, norm = step(data.batch(n - 1), n)
        scheduler.step()
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
        if cfg.validation.enable and validation.due(n, last=False):  # between steps, as train.py does
            validation.run(n)
    result.update(validation.run(t.steps))
    drop = {alias for names in model.tied_weights() for alias in names[1:]}
    return {**result, "final": full_weights(parts.modules, submesh(mesh, "pp"), drop)}


if __name__ == "__main__":
    run_each(run)
