"""A pipeline rank whose stages are traced in two processes at once
(planning/stages_apart.py) reports what one process tracing every micro-batch of every
stage reports, byte for byte: the peak and its categories, the memory between steps,
every collective's count and bytes, the parameter counts.

The reference is the dry run with ``every_microbatch=True`` (never split), as in
tests/test_alike_microbatches.py. The check fails when what the forked process traced is
not played back in full: with its records' net changes dropped, the memory between steps
differs."""

import dataclasses
from types import SimpleNamespace

import pytest

from meshtrain.planning import forked, stages_apart
from meshtrain.planning import traced_step
from meshtrain.planning.dry_run import dry_run
from meshtrain.training.config_loader import load_config

PIPE = ["--parallelism.pp=2", "--parallelism.pp_stages_per_rank=2", "--parallelism.pp_microbatches=8"]
CASES = {  # id: (world size, rank, overrides of debug_2d); the fast tier runs the first
    "interleaved_first_rank": (4, 0, [*PIPE, "--parallelism.tp=1", "--parallelism.pp_schedule=Interleaved1F1B",
                                      "--training.global_batch_size=16"]),
    "interleaved_last_rank_accumulating": pytest.param(
        (4, 3, [*PIPE, "--parallelism.tp=1", "--parallelism.pp_schedule=Interleaved1F1B",
                "--training.global_batch_size=32"]), marks=pytest.mark.slow),
    "looped_bfs_tp": pytest.param(
        (8, 1, [*PIPE, "--parallelism.tp=2", "--parallelism.pp_schedule=LoopedBFS",
                "--training.global_batch_size=16"]), marks=pytest.mark.slow),
}
COMPARED = ("memory", "memory_between_steps", "comm", "parameters")


def split_and_whole(monkeypatch, world_size, rank, over):
    monkeypatch.setattr(forked, "default_jobs", lambda: 2)
    calls = []

    def counted(*args, **kw):
        calls.append(args[3])  # the stages traced in the forked process
        return stages_apart.trace_apart(*args, **kw)

    monkeypatch.setattr(traced_step, "trace_apart", counted)
    split = dry_run(load_config("debug_2d", over), world_size, rank, quiet=True)
    whole = dry_run(load_config("debug_2d", over), world_size, rank, quiet=True, every_microbatch=True)
    assert len(calls) == 1 and len(calls[0]) == 1, calls  # one of the rank's two stages went
    return split, whole


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_ranks_stages_traced_apart_report_what_one_trace_of_the_step_reports(monkeypatch, case):
    split, whole = split_and_whole(monkeypatch, *case)
    for key in COMPARED:
        assert split[key] == whole[key], key


def test_without_the_forked_stages_memory_the_report_differs(monkeypatch):
    """The check above can fail: the forked process's records played without what each
    action leaves behind (its gradients, the activations it keeps)."""
    kept = stages_apart._highest_only
    zero = lambda net: {dev: {k: 0 for k in cats} for dev, cats in net.items()}
    monkeypatch.setattr(stages_apart, "_highest_only", lambda record: dataclasses.replace(kept(record), net=zero(record.net)))
    split, whole = split_and_whole(monkeypatch, *CASES["interleaved_first_rank"])
    assert split["memory_between_steps"] != whole["memory_between_steps"]


def test_stages_are_shared_out_by_their_traced_work():
    """Each stage's traced forwards times its layers; the heaviest first, each to the
    lighter side: 8 here, then 6 and 2 away, then 1 here (9 against 8)."""
    layout = SimpleNamespace(stage_layers=[[0, 1, 2], [3], [4, 5, 6, 7], [8]])
    assert stages_apart.away_stages({0: 2, 1: 1, 2: 2, 3: 2}, layout) == [0, 3]
