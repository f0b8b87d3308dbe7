"""`meshtrain plan --verify K`: the planner's top layouts, each dry-run at full
world size (planning/dry_run.py) and re-ranked by traced memory."""

from __future__ import annotations

from meshtrain.physics.gpus import GIB, usable_bytes
from meshtrain.planning.estimate import Estimate
from meshtrain.planning.forked import map_forked
from meshtrain.planning.report import describe, to_toml
from meshtrain.planning.shape import Job


def trace(e: Estimate, job: Job) -> dict:
    """The dry run's report of a layout: its config as --write would write it, traced at
    the job's world size on the first rank of the pipeline rank the estimate says is fullest."""
    import tempfile
    from pathlib import Path

    from meshtrain.planning.dry_run import dry_run
    from meshtrain.training.config_loader import load_config

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "traced.toml"
        path.write_text(to_toml(e, job, path.stem, "meshtrain plan --verify"))
        rank = e.memory.pp_rank * (job.world // e.layout.pp)  # pp is the outermost mesh dimension
        return dry_run(load_config(path), job.world, rank, gpus_per_node=job.gpus_per_node, quiet=True)


def verify(estimates: list[Estimate], job: Job, jobs: int | None = None) -> list[Estimate]:
    """Trace each layout and print traced beside estimated peaks; a layout whose trace does
    not fit drops to the end, and one where the two differ by more than 10% is flagged.
    Returns the layouts re-ranked: those the trace says fit, fastest first, then the others.
    The dry runs are independent: one forked process per core (``jobs``, planning/forked.py)."""
    print(f"\nVerifying the top {len(estimates)} with a dry run each ({job.world} ranks, fake tensors):", flush=True)
    traced = list(zip(estimates, map_forked(lambda e: _peak(trace(e, job)), estimates, jobs)))
    for i, (e, (peak, seconds)) in enumerate(traced, 1):
        off = peak / e.memory.total - 1
        flag = "  <-- differ by more than 10%" if abs(off) > 0.10 else ""
        fits = "fits" if peak <= usable_bytes(job.gpu) else "does NOT fit"
        print(f"  {i}. {describe(e.layout)}: estimated {e.memory.total / GIB:.1f} GiB, traced "
              f"{peak / GIB:.1f} GiB ({off:+.0%}, {seconds:.0f} s), {fits}{flag}")
    ok = [e for e, (peak, _) in traced if peak <= usable_bytes(job.gpu)]
    return ok + [e for e, (peak, _) in traced if peak > usable_bytes(job.gpu)]


def _peak(report: dict) -> tuple[int, float]:
    return report["memory"]["total"], report["seconds"]
