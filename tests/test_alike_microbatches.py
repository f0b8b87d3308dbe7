"""A pipeline dry run that traces each kind of micro-batch once and repeats its record for
the alike ones (planning/alike_microbatches.py) reports what tracing every micro-batch
reports, byte for byte: the peak and its categories, the memory between steps, every
collective's count and bytes, the parameter counts.

The reference is the same dry run with ``every_microbatch=True``: torch's memory tracker
over every forward and backward of the replay, itself checked against real tensors in
tests/test_dry_run.py. The check fails when what sets an action's program is missed: a
history without the stage's forward count repeats its second forward (where the tracker
files the weights the first one gathered under parameters) for later ones."""

import pytest

from meshtrain.planning import alike_microbatches
from meshtrain.planning import dry_run as dry_run_module
from meshtrain.planning.alike_microbatches import copies, histories
from meshtrain.planning.dry_run import dry_run
from meshtrain.planning.schedule import rank_actions, replay_prefix
from meshtrain.training.config_loader import load_config

PIPE = ["--parallelism.pp=2", "--parallelism.tp=1"]
INTERLEAVED = (4, 0, [*PIPE, "--parallelism.pp_schedule=Interleaved1F1B", "--parallelism.pp_stages_per_rank=2",
                      "--parallelism.pp_microbatches=8", "--training.global_batch_size=16"])
# Three blocks a stage: FULL_SHARD frees the first two's weights after each forward.
INTERLEAVED_FULL_SHARD = (4, 0, [*INTERLEAVED[2], "--parallelism.sharding_strategy=FULL_SHARD", "--model.n_layers=12"])
slow = lambda case: pytest.param(case, marks=pytest.mark.slow)
CASES = {  # id: (world size, rank, overrides of debug_2d); the fast tier runs the first
    "interleaved_first_rank": INTERLEAVED,
    "interleaved_last_rank_accumulating": slow((4, 3, [*PIPE, "--parallelism.pp_schedule=Interleaved1F1B",
                                                  "--parallelism.pp_stages_per_rank=2",
                                                  "--parallelism.pp_microbatches=8",
                                                  "--training.global_batch_size=32"])),
    "1f1b_four_stages": slow((8, 0, ["--parallelism.pp=4", "--parallelism.tp=1", "--parallelism.pp_schedule=1F1B",
                                "--parallelism.pp_microbatches=8", "--training.global_batch_size=16"])),
    "gpipe_full_shard_last_stage": slow((4, 2, [*PIPE, "--parallelism.pp_schedule=GPipe",
                                           "--parallelism.pp_microbatches=4",
                                           "--parallelism.sharding_strategy=FULL_SHARD",
                                           "--training.global_batch_size=8"])),
    "interleaved_full_shard": slow(INTERLEAVED_FULL_SHARD),
    "looped_bfs_tp": slow((8, 1, [*PIPE[:1], "--parallelism.tp=2", "--parallelism.pp_schedule=LoopedBFS",
                             "--parallelism.pp_stages_per_rank=2", "--parallelism.pp_microbatches=6",
                             "--training.global_batch_size=12"])),
}
COMPARED = ("memory", "memory_between_steps", "comm", "parameters")


def both(world_size, rank, over, **kw):
    copied = dry_run(load_config("debug_2d", over), world_size, rank, quiet=True, **kw)
    every = dry_run(load_config("debug_2d", over), world_size, rank, quiet=True, every_microbatch=True, **kw)
    assert "repeating an alike one" in copied["traced"]  # else this compares a full trace with itself
    assert "repeating" not in every["traced"]
    return copied, every


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_repeating_alike_microbatches_equals_tracing_every_one(case):
    copied, every = both(*case)
    for key in COMPARED:
        assert copied[key] == every[key], key


@pytest.mark.slow
def test_repeated_microbatches_and_extrapolated_blocks_together_equal_tracing_everything(monkeypatch):
    """The copies' updates join the timeline planning/alike_memory.py extrapolates from."""
    monkeypatch.setattr(dry_run_module, "worth_it", lambda real: len(real) > 0)
    over = ["--model.n_layers=20", *INTERLEAVED[2]]  # stages of 5 blocks: 3 and 4 traced
    copied = dry_run(load_config("debug_2d", over), 4, 0, quiet=True)
    every = dry_run(load_config("debug_2d", over), 4, 0, quiet=True, every_block=True, every_microbatch=True)
    assert "repeating an alike one" in copied["traced"] and "the rest extrapolated" in copied["traced"]
    for key in COMPARED:
        assert copied[key] == every[key], key


def test_without_the_forward_count_the_second_forwards_filing_is_repeated(monkeypatch):
    """The check above can fail: a history that leaves the count out (``[:4]``) lets later
    forwards repeat the second one, which moves the gathered weights from activations to
    parameters; repeated, that move is counted again and again."""
    monkeypatch.setattr(alike_microbatches, "histories", lambda *args: [h[:4] for h in histories(*args)])
    copied, every = both(*INTERLEAVED)
    assert copied["memory_between_steps"] != every["memory_between_steps"]


@pytest.mark.parametrize("schedule,pp,v,m", [("1F1B", 8, 1, 32), ("GPipe", 4, 1, 16), ("LoopedBFS", 4, 2, 16),
                                             ("Interleaved1F1B", 8, 2, 32), ("Interleaved1F1B", 4, 2, 256)])
def test_a_copy_repeats_an_earlier_traced_microbatch_of_its_stage_and_the_traced_keep_their_histories(
        schedule, pp, v, m):
    for rank, listed in enumerate(rank_actions(schedule, pp, v, m)):
        actions = replay_prefix(listed)
        found, whole = copies(actions), histories(actions)
        at = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
        for (s, mb), (t, like) in found.items():
            assert s == t and (t, like) not in found
            for kind in "FB":
                assert at[kind, t, like] < at[kind, s, mb] and whole[at[kind, t, like]] == whole[at[kind, s, mb]]
        kept = [i for i, a in enumerate(actions) if (a.stage, a.microbatch) not in found]
        assert histories([actions[i] for i in kept]) == [whole[i] for i in kept]


def test_llama405b_3d_rank_0_traces_8_of_its_48_forwards():
    """pp 8, 2 stages a rank, 32 micro-batches (configs/llama405b_3d.toml): its stages keep
    their weights gathered (SHARD_GRAD_OP), so four forwards of each are traced; 17 in all
    if they freed them after each forward."""
    first = replay_prefix(rank_actions("Interleaved1F1B", 8, 2, 32)[0])
    assert sum(a.kind == "F" for a in first) == 48
    assert (len(copies(first, keep_gathered={0, 8})), len(copies(first))) == (40, 31)


def test_a_stage_that_frees_its_weights_after_forward_taken_for_one_that_keeps_them_misses_the_peak(monkeypatch):
    """The check above can fail: under FULL_SHARD what a stage ran last decides whether a
    forward gathers its weights again, and a history without it copies a wrong record."""
    from meshtrain.planning import traced_step

    world, rank, over = INTERLEAVED_FULL_SHARD
    every = dry_run(load_config("debug_2d", over), world, rank, quiet=True, every_microbatch=True)
    monkeypatch.setattr(traced_step, "keep_gathered", lambda parts: frozenset(s for s, _ in parts))
    wrong = dry_run(load_config("debug_2d", over), world, rank, quiet=True)
    assert wrong["memory"] != every["memory"]


def test_a_copy_sets_the_peak_that_playing_each_of_its_updates_sets():
    """Where only the peak is read (no timeline, no recording), a copy plays the record's
    first highest update alone: the same peak and categories as playing every update."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtrain.planning.alike_microbatches import Copier, Record
    from meshtrain.planning.collectives import CommStats
    from meshtrain.planning.fake_world import peak_only

    deltas = [{"cpu": {"Total": t, "Activation": a}} for t, a in [(10, 10), (40, 5), (40, 7), (20, 20)]]
    peaks = []
    for every in (False, True):
        tracker = peak_only(MemTracker)()
        tracker._curr_mem_snap = {"cpu": {"Total": 100, "Activation": 50}}
        tracker.recording = [] if every else None  # a recording is read update by update
        copier = Copier(tracker, type("Comm", (), {"stats": CommStats()})())
        copier.records["F", (0, 0)] = Record(deltas, None, {"cpu": {"Total": 0, "Activation": 0}}, [])
        copier.copy("F", (0, 0), "forward")
        peaks.append(tracker._peak_mem_snap["cpu"])
    assert peaks[0] == peaks[1] == {"Total": 140, "Activation": 55}
