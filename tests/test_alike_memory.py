"""The dry run of a deep stage from two shallow traces (planning/alike_memory.py) gives
what tracing every block gives, byte for byte: the peak and its categories, the memory
between steps, every collective's count and bytes, and the parameter counts.

The reference is the same dry run with ``every_block=True``: torch's memory tracker over
the whole step, itself checked against real tensors in tests/test_dry_run.py. The check
fails when the extrapolation is wrong: without the middle blocks' slope along the run
(activations saved block after block) every case with its peak in the forward or early
backward is off by (n - 3) blocks' activations."""

import pytest

from meshtrain.planning import dry_run as dry_run_module
from meshtrain.planning.alike_blocks import KEEP
from meshtrain.planning.alike_memory import Shallow, Timeline, extrapolate, line_up
from meshtrain.planning.dry_run import dry_run
from meshtrain.training.config_loader import load_config

DEEP = "--model.n_layers=6"  # 3 and 4 blocks traced, 6 extrapolated
CASES = {  # id: (config, world size, rank, overrides)
    "fsdp_tp_accumulation": ("debug_2d", 4, 1, [DEEP, "--training.local_batch_size=2"]),
    "full_ac_shard_grad_op": ("debug_2d", 4, 0, [DEEP, "--activation_checkpoint.mode=full",
                                                  "--parallelism.sharding_strategy=SHARD_GRAD_OP"]),
    "op_ac_hybrid_shard": ("debug_2d", 8, 5, [DEEP, "--activation_checkpoint.mode=op", "--parallelism.dp_replicate=2",
                                              "--parallelism.sharding_strategy=HYBRID_SHARD",
                                              "--training.global_batch_size=16"]),
    "no_shard": ("debug_2d", 4, 0, [DEEP, "--parallelism.dp_replicate=4", "--parallelism.dp_shard=1",
                                    "--parallelism.tp=1", "--parallelism.sharding_strategy=NO_SHARD"]),
    "pipeline_1f1b_last_stage": ("debug_2d", 4, 2, ["--model.n_layers=12", "--parallelism.pp=2",
                                                    "--parallelism.pp_schedule=1F1B", "--parallelism.tp=1"]),
    "cp_document_masking_chunked_loss": ("debug_2d", 4, 0, [DEEP, "--parallelism.cp=2", "--parallelism.tp=1",
                                                            "--training.document_masking=true",
                                                            "--training.chunked_loss=true"]),
    "moe_expert_parallel": ("moe_debug", 4, 1, [DEEP, "--training.seq_len=64"]),
    "lora": ("debug_2d", 4, 0, [DEEP, "--lora.enable=true"]),
}
COMPARED = ("memory", "memory_between_steps", "comm", "parameters")


@pytest.fixture(autouse=True)
def shallow_from_six_blocks(monkeypatch):
    """Extrapolate whenever a run is longer than 4 blocks: at 6 the whole-depth reference
    is cheap (a real dry run waits for more, `worth_it`, as three traces must beat one)."""
    monkeypatch.setattr(dry_run_module, "worth_it", lambda real: len(real) > 0)


def both(name, world_size, rank, over):
    shallow = dry_run(load_config(name, over), world_size, rank, quiet=True)
    every = dry_run(load_config(name, over), world_size, rank, quiet=True, every_block=True)
    return shallow, every


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_dry_run_from_two_shallow_traces_equals_tracing_every_block(case):
    shallow, every = both(*case)
    assert "the rest extrapolated" in shallow["traced"]  # else this compares a full trace with itself
    assert "extrapolated" not in every["traced"]
    for key in COMPARED:
        assert shallow[key] == every[key], key


def test_an_interleaved_rank_extrapolates_each_of_its_stages():
    """Two local stages: a second trace for each."""
    shallow, every = both("debug_2d", 4, 0, ["--model.n_layers=24", "--parallelism.pp=2", "--parallelism.tp=1",
                                             "--parallelism.pp_schedule=Interleaved1F1B",
                                             "--parallelism.pp_stages_per_rank=2", "--parallelism.pp_microbatches=2"])
    assert "3 and 4 of 6 + 6 alike" in shallow["traced"]
    for key in COMPARED:
        assert shallow[key] == every[key], key


@pytest.mark.parametrize("over", [["--activation_checkpoint.mode=selective"], ["--optimizer.name=Muon"]],
                         ids=["selective_ac", "muon"])
def test_blocks_that_differ_by_position_or_depth_are_all_traced(over):
    """Selective AC wraps every k-th block; Muon shares the matrices out over the shard
    group, padded to a multiple of it: neither is affine in the depth."""
    report = dry_run(load_config("debug_2d", [DEEP, *over]), 4, quiet=True)
    assert "extrapolated" not in report["traced"]


def test_traces_that_are_not_one_block_apart_do_not_line_up():
    f, m, last = ("forward", (0, 0, 0)), ("forward", (0, 0, 1)), ("forward", (0, 0, 2))
    base = [f, m, m, last]
    assert line_up(base, [f, m, m, ("forward", (0, 0, 2)), ("forward", (0, 0, 2)), ("forward", (0, 0, 3))], (0, 0))
    # the added middle block ran other updates than the first middle block
    assert line_up(base, [f, m, m, ("forward", (0, 0, 2)), ("forward", (0, 0, 3))], (0, 0)) is None
    # something else changed
    assert line_up(base, [f, m, m, ("backward", (0, 0, 2)), ("forward", (0, 0, 2)), ("forward", (0, 0, 3))],
                   (0, 0)) is None


def program(n: int, act: int = 10, ahead: int = 25, shard: int = 3, spike: int = 0) -> Shallow:
    """A step of n alike blocks as its memory updates, written out: each forward saves
    `act` and, but for the last block, gathers the next block ahead (`ahead`, freed when
    that block is done); the backward frees the saved activations and keeps a gradient
    shard per block, a middle block's backward also holding `spike` for a moment. With
    `ahead` above `act` the peak is the forward of block n - 2, the last middle block:
    the case where a middle block's index decides the peak."""
    state = 7
    tags, snaps = [], []

    def update(phase, block: int, activations: int, gathered: int, grads: int, temp: int = 0):
        snap = {"Activation": activations, "All Gather": gathered, "Sharded Grad": grads, "OptState": state * n,
                "Temp": temp}
        snap["Total"] = sum(snap.values())
        tags.append((phase, (0, 0, block)))  # as traced at n = 3 and 4: position = index
        snaps.append(snap)

    for i in range(n):
        update("forward", i, act * i, 0, 0)
        update("forward", i, act * (i + 1), ahead if i < n - 1 else 0, 0)
    for i in reversed(range(n)):
        update("backward", i, act * (i + 1), 0, shard * (n - 1 - i), spike if 0 < i < n - 1 else 0)
        update("backward", i, act * i, 0, shard * (n - i))
    timeline = Timeline(None)
    timeline.tags, timeline.snaps = tags, snaps
    return Shallow(timeline, snaps[-1], {}, {})


def test_a_peak_in_the_last_middle_block_is_found_at_the_real_depth():
    n = 9
    whole = program(n).timeline.snaps
    expected = max(whole, key=lambda s: s["Total"])
    assert expected is whole[2 * (n - 2) + 1]  # the forward of block n - 2, gathering the last ahead
    peak, after, _, _ = extrapolate(program(KEEP), {(0, 0): program(KEEP + 1)}, {(0, 0): n})
    assert peak == expected
    assert after == whole[-1]


def test_of_equal_peaks_the_one_the_step_meets_first_is_reported():
    """The tracker keeps the first of equal peaks. With a gradient shard as large as a
    block's activations every middle block's backward holds the same total, split
    differently; the backward meets block n - 2 first, so its split is the one reported."""
    n, shape = 9, dict(act=10, ahead=0, shard=10, spike=50)
    whole = program(n, **shape).timeline.snaps
    expected = max(whole, key=lambda s: s["Total"])  # max() keeps the first, as the tracker does
    assert expected is whole[2 * n + 2]  # the backward of block n - 2 (after the last block's two updates)
    peak, _, _, _ = extrapolate(program(KEEP, **shape), {(0, 0): program(KEEP + 1, **shape)}, {(0, 0): n})
    assert peak == expected
