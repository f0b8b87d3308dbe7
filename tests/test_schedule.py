"""planning/schedule.py reads torch's own description of its pipeline schedules (private
methods): these pin what it returns, so a torch upgrade that changes it fails here first."""

import pytest

from meshtrain.planning.schedule import (Action, in_flight_at_peak, makespan, rank_actions, replay_prefix,
                                         replayed_actions)


def counts(actions):
    return {kind: sum(a.kind == kind for a in actions) for kind in "FB"}


@pytest.mark.parametrize("schedule, pp, v, m", [("1F1B", 4, 1, 8), ("GPipe", 2, 1, 3),
                                                ("Interleaved1F1B", 8, 2, 32), ("LoopedBFS", 2, 2, 4)])
def test_every_rank_runs_each_microbatch_of_each_of_its_stages_once_each_way(schedule, pp, v, m):
    for rank, actions in enumerate(rank_actions(schedule, pp, v, m)):
        stages = {rank + k * pp for k in range(v)}  # looped placement
        for kind in "FB":
            assert sorted((a.stage, a.microbatch) for a in actions if a.kind == kind) == \
                sorted((s, i) for s in stages for i in range(m))
        for s, i in {(a.stage, a.microbatch) for a in actions}:  # a backward after its forward
            order = [a.kind for a in actions if (a.stage, a.microbatch) == (s, i)]
            assert order == ["F", "B"]


def test_1f1b_keeps_pp_minus_rank_in_flight_and_gpipe_all():
    peaks = [in_flight_at_peak(a, {r: 1.0})[0] for r, a in enumerate(rank_actions("1F1B", 4, 1, 8))]
    assert peaks == [4, 3, 2, 1]
    assert [in_flight_at_peak(a, {r: 1.0})[0] for r, a in enumerate(rank_actions("GPipe", 2, 1, 3))] == [3, 3]


def test_interleaved_holds_both_stages_at_once():
    """llama405b_3d: pp 8, 2 stages per rank, 32 micro-batches. Rank 1 holds 13 micro-batches
    of stage 1 and 8 of stage 9 when its backward starts: 21 in flight together, where
    tracing each stage alone would see at most 15."""
    actions = rank_actions("Interleaved1F1B", 8, 2, 32)[1]
    held, per_stage, running = in_flight_at_peak(actions, {1: 1.0, 9: 1.0})
    assert (held, per_stage) == (21, {1: 13, 9: 8})


def test_unsupported_schedules_say_which_are():
    with pytest.raises(NotImplementedError, match="1F1B"):
        rank_actions("ZBVZeroBubble", 2, 2, 4)
    assert Action("F", 0, 0) != Action("B", 0, 0)


def _peak(actions, weight, begun_bytes, gathered_bytes):
    """The most memory at any backward: micro-batches in flight x their weight, what each
    stage holds from its first backward on (gradients accumulating), and each stage's
    gathered parameters from a backward until its next forward (FULL_SHARD reshards there)."""
    live, begun, gathered, best = {s: 0 for s in weight}, set(), set(), 0.0
    for a in actions:
        if a.kind == "F":
            live[a.stage] += 1
            gathered.discard(a.stage)
            continue
        begun.add(a.stage)
        gathered.add(a.stage)
        best = max(best, sum(live[s] * weight[s] for s in live) + sum(begun_bytes[s] for s in begun)
                   + sum(gathered_bytes[s] for s in gathered))
        live[a.stage] -= 1
    return best


def _estimate_peak(actions, weight, after, running):
    """The memory estimate's worst backward (planning/memory.py traced_memory): in-flight
    micro-batches x their weight, what every stage that has had a backward holds (gathered,
    gradients accumulating), and, on a stage's first backward, its running block instead."""
    live, done, best = {s: 0 for s in weight}, set(), 0.0
    for a in actions:
        if a.kind == "F":
            live[a.stage] += 1
            continue
        best = max(best, sum(live[s] * weight[s] for s in live) + sum(after[s] for s in done)
                   + (running[a.stage] if a.stage not in done else 0.0))
        live[a.stage] -= 1
        done.add(a.stage)
    return best


@pytest.mark.parametrize("schedule, pp, v, m", [("1F1B", 4, 1, 8), ("1F1B", 16, 1, 64), ("GPipe", 4, 1, 8),
                                                ("Interleaved1F1B", 2, 2, 4), ("Interleaved1F1B", 8, 2, 32),
                                                ("Interleaved1F1B", 4, 2, 256), ("LoopedBFS", 2, 2, 4)])
def test_the_replayed_prefix_meets_the_peak_of_the_whole_list_and_drains(schedule, pp, v, m):
    import random

    rng = random.Random(0)
    for rank, actions in enumerate(rank_actions(schedule, pp, v, m)):
        prefix = replay_prefix(actions)
        assert replayed_actions(schedule, pp, v, m, rank) == tuple(prefix)  # what the estimate walks
        stages = {a.stage for a in actions}
        assert counts(prefix)["F"] == counts(prefix)["B"] <= counts(actions)["F"]
        for _ in range(20):  # whatever the activations, gradients and gathered stages weigh
            weight = {s: rng.uniform(0, 1) for s in stages}
            begun = {s: rng.uniform(0, 5) for s in stages}
            gathered = {s: rng.uniform(0, 5) for s in stages}
            assert _peak(prefix, weight, begun, gathered) == pytest.approx(_peak(actions, weight, begun, gathered))
            running = {s: rng.uniform(0, 5) for s in stages}  # may weigh more than a whole stage's states
            assert _estimate_peak(prefix, weight, begun, running) == _estimate_peak(actions, weight, begun, running)
    long = rank_actions(schedule, pp, v, m)[0]
    if m >= 64:  # the warm-up and one round, not every micro-batch
        assert len(replay_prefix(long)) < len(long) // 3


@pytest.mark.parametrize("schedule, pp, v, m", [("1F1B", 4, 1, 8), ("GPipe", 4, 1, 8), ("1F1B", 8, 1, 256),
                                                ("Interleaved1F1B", 4, 2, 8), ("Interleaved1F1B", 8, 2, 32)])
def test_playing_torchs_schedule_gives_the_textbook_bubble(schedule, pp, v, m):
    """Forward 1, backward 2 per stage: fill and drain cost (pp - 1) micro-batch slots of
    one rank's work, v times shorter when each rank holds v stages (Narayanan et al. 2021)."""
    busy = m * v * (1 + 2)
    assert makespan(schedule, pp, v, m, 1.0, 2.0) - busy == pytest.approx((pp - 1) * 3)
    # Unequal forward and backward: 1F1B's fill is pp - 1 forwards, its drain pp - 1 backwards.
    if schedule == "1F1B":
        assert makespan(schedule, pp, v, m, 1.0, 5.0) == pytest.approx(m * 6 + (pp - 1) * 6)


@pytest.mark.parametrize("pp, m", [(16, 16), (16, 64), (32, 32)])
def test_a_send_between_ranks_delays_a_deep_pipeline_by_its_fill_and_drain_hops(pp, m):
    """GPipe: rank r's first forward waits for r hops down, the first stage's last backward
    for pp - 1 hops back up; the steady state has slack. So a transfer time d between ranks
    lengthens the step by exactly 2 (pp - 1) d: (m + pp - 1)(f + b) + 2 (pp - 1) d.
    1F1B pays at least the same fill and drain, and more: its steady state has no slack, so
    each backward waits for the next rank's round trip."""
    d = 0.01
    assert makespan("GPipe", pp, 1, m, 1.0, 2.0, d) == pytest.approx((m + pp - 1) * 3 + 2 * (pp - 1) * d)
    assert makespan("1F1B", pp, 1, m, 1.0, 2.0, d) - makespan("1F1B", pp, 1, m, 1.0, 2.0) > 2 * (pp - 1) * d
    # Interleaved: consecutive stages sit on different ranks, every hop counts as well.
    assert makespan("Interleaved1F1B", pp, 2, m, 0.5, 1.0, d) > makespan("Interleaved1F1B", pp, 2, m, 0.5, 1.0)


@pytest.mark.parametrize("schedule, pp, m", [("GPipe", 16, 32), ("1F1B", 16, 32), ("1F1B", 4, 8)])
def test_a_heavier_last_stage_lengthens_the_step_by_its_extra_on_every_microbatch(schedule, pp, m):
    """The output layer and loss make the last stage x heavier per micro-batch. It runs all
    m micro-batches on the critical path; the other stages' fill and drain keep their own
    (lighter) time: the step grows by m x, not by the (m + pp - 1) x of charging every stage
    as the heaviest."""
    x = 0.3
    forward, backward = [1.0] * pp, [2.0] * pp
    forward[-1], backward[-1] = 1.0 + x / 3, 2.0 + 2 * x / 3
    assert makespan(schedule, pp, 1, m, forward, backward) == pytest.approx((m + pp - 1) * 3 + m * x)
