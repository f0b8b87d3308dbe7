"""Train several `train.py` command lines a few steps in one torchrun job -- evaluating
between steps as train.py does when [validation] enable is on -- then evaluate each with
training/evaluate.py, and record the losses, gradient norms, the validation loss and the
full weights it was computed from (the plain-PyTorch reference in tests/test_validation.py
recomputes it):

    torchrun --nproc-per-node 4 tests/workers/validation_runs.py OUT_DIR RUNS.json

RUNS.json maps a run name to its train.py arguments; results go to OUT_DIR/NAME.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.parallel import mesh_coordinate, shutdown_distributed, submesh
from meshtrain.training import recipe
from meshtrain.training.config_loader import parse_args
from meshtrain.training.data import build_dataloader, build_tokenizer
from meshtrain.training.evaluate import Validation
from tests.workers.recipe_runs import full_weights


def run(argv: list[str]) -> dict:
    cfg, _ = parse_args(argv)
    t = cfg.training
    torch.manual_seed(t.seed)
    model = recipe.build_model(cfg, build_tokenizer(t.tokenizer).vocab_size)
    layout = recipe.plan_layout(cfg, model)
    mesh = layout.build_mesh("cpu")
    parts = recipe.build_parts(cfg, layout, mesh, model)
    for part in parts.modules:
        part.init_weights(seed=t.seed, device="cpu")
    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    data, _ = build_dataloader(t, dp_rank=dp_rank, dp_size=dp_size, held_out=cfg.validation.split)
    optimizer, scheduler = recipe.build_optimizer(cfg, parts.modules)
    step = recipe.build_step(cfg, layout, parts, optimizer, torch.device("cpu"))
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
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for name, argv in runs.items():
        result = run(argv)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    shutdown_distributed()
