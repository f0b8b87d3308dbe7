"""The hang report in one process: a rank's watchdog writing where it is when it stops
moving, and the summary's reading of the records. The whole thing under torchrun, with a
rank stalled on purpose, is tests/test_faults.py's stalled-rank test."""

import json
import time

import pytest
import torch
import torch.distributed as dist

from meshtrain.training import hang_report
from meshtrain.training.faults import step_phase


@pytest.fixture
def gloo_mesh():
    """A real gloo group of one rank in this process, and a mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def stuck_in_a_long_computation(seconds):
    time.sleep(seconds)


def test_a_rank_making_no_progress_writes_where_it_is_and_its_stacks_then_removes_them_when_it_moves(
        tmp_path, gloo_mesh):
    watch = hang_report.HangWatch(tmp_path, gloo_mesh, timeout=1.0).start()  # looks every 0.1 s
    try:
        with step_phase(7, "forward/backward"):
            hang_report.where.micro_batch = 2
            stuck_in_a_long_computation(2.0)
            text = (tmp_path / "hang" / "rank0.txt").read_text()
            record = json.loads((tmp_path / "hang" / "rank0.json").read_text())
            dist.all_reduce(torch.ones(1))  # it moves again: a collective issued
            time.sleep(0.5)  # a few looks, less than the timeout
        assert not list((tmp_path / "hang").glob("rank0.*")), "a rank that moved on still has a hang record"
    finally:
        watch.stop()
    assert "at step 7, forward/backward, micro-batch 2" in text
    assert "in stuck_in_a_long_computation" in text  # the main thread's stack, dumped from the watchdog's
    assert record["step"] == 7 and record["micro_batch"] == 2 and record["inside_phase"]
    assert record["groups"]["0"] == {"desc": "default_pg", "ranks": [0], "issued": 0}


def record(rank, step, phase, inside, groups):
    """A rank's record as HangWatch.write makes it; ``groups``: name -> (desc, ranks, issued)."""
    return {"rank": rank, "why": "test", "step": step, "phase": phase, "inside_phase": inside,
            "micro_batch": 0 if inside else None, "mesh": {},
            "groups": {name: {"desc": d, "ranks": r, "issued": n} for name, (d, r, n) in groups.items()}}


def dp2_tp2(issued):
    """Four ranks, tp groups {0,1} {2,3}, dp groups {0,2} {1,3}; ``issued[rank] = (tp, dp)``."""
    records = {}
    for rank, (tp, dp) in issued.items():
        tp_group = ("tp", [rank - rank % 2, rank - rank % 2 + 1], tp)
        dp_group = ("dp_shard", [rank % 2, rank % 2 + 2], dp)
        records[rank] = record(rank, 3, "forward/backward", True,
                               {f"tp{rank // 2}": tp_group, f"dp{rank % 2}": dp_group})
    return records


def behind(summary):
    return next(line for line in summary.splitlines() if line.startswith("behind:"))


def test_the_summary_names_the_rank_the_others_wait_for_not_those_waiting_behind_it():
    # Rank 1 stalled before step 3. Rank 3 waits for it in their dp group, so rank 3 is
    # behind rank 2 in their tp group too: it is waiting, not the cause.
    records = dp2_tp2({0: (11, 6), 1: (10, 5), 2: (11, 6), 3: (10, 6)})
    records[1].update(step=2, phase="checkpoint save", inside_phase=False)
    summary = hang_report.summarize(records, 4)
    assert behind(summary) == "behind: rank 1", summary
    assert "rank 1: step 2, after checkpoint save" in summary
    assert "rank 3: step 3, forward/backward, micro-batch 0; waits for rank 1 (dp_shard)" in summary


def test_a_rank_without_a_record_is_named_behind_and_those_waiting_for_it_are_not():
    # Rank 1 died: rank 3 waits for it in their dp group and rank 2 for rank 3 in theirs.
    records = dp2_tp2({0: (11, 6), 2: (11, 6), 3: (10, 6)})
    summary = hang_report.summarize(records, 4)
    assert behind(summary) == "behind: rank 1", summary
    assert "rank 1: no record" in summary
    assert "rank 3: step 3, forward/backward, micro-batch 0; waits for rank 1 (dp_shard)" in summary


def test_ranks_waiting_for_each_other_in_a_cycle_are_called_so():
    # 0 issued more tp collectives than 1, 1 more dp ones... a mismatched order.
    records = {0: record(0, 3, "x", True, {"a": ("tp", [0, 1], 5), "b": ("dp_shard", [0, 1], 3)}),
               1: record(1, 3, "x", True, {"a": ("tp", [0, 1], 4), "b": ("dp_shard", [0, 1], 4)})}
    assert "in a cycle" in behind(hang_report.summarize(records, 2))


def test_the_tool_prints_the_summary_from_the_run_folder(tmp_path, capsys):
    records = dp2_tp2({0: (11, 6), 1: (10, 5), 2: (11, 6), 3: (10, 6)})
    (tmp_path / "hang").mkdir()
    for rank, rec in records.items():
        (tmp_path / "hang" / f"rank{rank}.json").write_text(json.dumps({**rec, "time": time.time()}))
    from meshtrain.cli import main

    assert main(["hang-report", str(tmp_path)]) == 0
    assert behind(capsys.readouterr().out) == "behind: rank 1"
    assert hang_report.main([str(tmp_path / "nothing")]) == 2
    assert "no hang records in" in capsys.readouterr().err


def test_a_phase_left_by_an_error_is_where_the_rank_was():
    with pytest.raises(RuntimeError), step_phase(4, "token count"):
        raise RuntimeError("Timed out waiting 5000ms")
    assert hang_report.describe_where({**hang_report.where.record(), "mesh": {"pp": 1}}) == \
        "step 4, token count, pipeline stage 1"
    with step_phase(4, "optimizer step"):
        pass
    assert hang_report.describe_where({**hang_report.where.record(), "mesh": {}}) == "step 4, after optimizer step"


def test_the_pipeline_group_whose_counts_hold_sends_and_receives_is_not_compared():
    # pp 3 x dp 2: stage s, replica d is rank 2s + d. On gloo a middle stage's sends and
    # receives count twice an end's. Rank 4 (the last stage of replica 0) stalled: rank 5
    # issued one more collective in their dp group.
    records = {}
    for rank in range(6):
        stage, replica = divmod(rank, 2)
        records[rank] = record(rank, 3, "pipeline forward/backward", True, {
            f"pp{replica}": ("mesh_pp", [replica, replica + 2, replica + 4], 80 if stage == 1 else 40),
            f"dp{stage}": ("mesh_dp_shard", [2 * stage, 2 * stage + 1], 8 if rank == 5 else 7)})
        records[rank]["pipeline_group"] = f"pp{replica}"
    summary = hang_report.summarize(records, 6)
    assert behind(summary) == "behind: rank 4", summary
