"""Train several `train.py` command lines in one torchrun job, through the recipe train.py
uses (training/recipe.py: model, layout, parts, optimizer, step; the same data loader),
and record for each its losses, gradient norms, full final weights and the last step's
full gradients (clipped, if clipping binds):

    torchrun --nproc-per-node 4 tests/workers/recipe_runs.py OUT_DIR RUNS.json

RUNS.json maps a run name to its train.py arguments; results go to OUT_DIR/NAME.pt.
(train.py itself cannot run twice in one process: its process group is torchrun's.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.parallel import mesh_coordinate, shutdown_distributed, submesh
from meshtrain.parallel.init import canonical_name
from meshtrain.training import recipe, step as training_step
from meshtrain.training.config_loader import parse_args
from meshtrain.training.data import build_dataloader, build_tokenizer


def full_weights(modules, pp_mesh, drop: set[str], grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (``grads``: its gradient) in full, from every pipeline stage, under its
    canonical name; ``drop``: tied copies (the oracle's model lists one weight once)."""
    mine = {}
    for module in modules:
        for name, p in module.named_parameters():
            if canonical_name(name) not in drop and not (grads and p.grad is None):  # frozen: no gradient
                t = p.grad if grads else p
                mine[canonical_name(name)] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    if pp_mesh is None:
        return mine
    everyone = [None] * pp_mesh.size()
    dist.all_gather_object(everyone, mine, group=pp_mesh.get_group())
    return {k: v for d in everyone for k, v in d.items()}


def placements_over(modules, dim: str = "tp") -> dict[str, str]:
    """Each parameter split over the mesh dimension ``dim``, by name: its placement there
    ("Shard(dim=0)")."""
    found = {}
    for module in modules:
        for name, p in module.named_parameters():
            names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
            if dim in names:
                found[canonical_name(name)] = str(p.placements[names.index(dim)])
    return dict(sorted(found.items()))


def build_run(argv: list[str]):
    """What train.py builds before its loop, on CPU, for the config ``argv`` names:
    (cfg, model, layout, mesh, parts, data, optimizer, scheduler, step)."""
    cfg, _ = parse_args(argv)
    t = cfg.training
    torch.manual_seed(t.seed)
    model = recipe.build_model(cfg, build_tokenizer(t.tokenizer).vocab_size)
    layout = recipe.plan_layout(cfg, model)
    mesh = layout.build_mesh("cpu")
    parts = recipe.build_parts(cfg, layout, mesh, model)
    for part in parts.modules:
        part.init_weights(seed=t.seed, device="cpu")
    recipe.load_initial_weights(cfg, parts)  # as train.py does without a checkpoint to resume
    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    data, _ = build_dataloader(t, dp_rank=dp_rank, dp_size=dp_size, held_out=cfg.validation.split)
    optimizer, scheduler = recipe.build_optimizer(cfg, parts.modules)
    step = recipe.build_step(cfg, layout, parts, optimizer, torch.device("cpu"))
    return cfg, model, layout, mesh, parts, data, optimizer, scheduler, step


def run(argv: list[str]) -> dict:
    cfg, model, layout, mesh, parts, data, optimizer, scheduler, step = build_run(argv)
    t = cfg.training
    result = {"losses": [], "grad_norms": []}
    for n in range(1, t.steps + 1):
        loss, norm = step(data.batch(n - 1), n)
        scheduler.step()
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
    drop = {alias for names in model.tied_weights() for alias in names[1:]}
    result["final"] = full_weights(parts.modules, submesh(mesh, "pp"), drop)
    result["grads"] = full_weights(parts.modules, submesh(mesh, "pp"), drop, grads=True)  # the last step's
    result["tp_sharded"] = placements_over(parts.modules, "tp")
    result["ep_sharded"] = placements_over(parts.modules, "ep")
    result["loss_function"] = training_step._loss_impl.__name__  # the cross-entropy build_step chose
    return result


def run_each(run) -> None:
    """A worker's command line, OUT_DIR RUNS.json: ``run(argv)`` for each named train.py
    command line in turn (one start-up for them all); rank 0 saves each result as OUT_DIR/NAME.pt."""
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for name, argv in runs.items():
        result = run(argv)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    run_each(run)
