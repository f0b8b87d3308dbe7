"""Faults a long run meets, injected for real: SIGKILLed ranks under torchrun's restarts,
a SIGTERM that reaches one rank, a stalled rank, a NaN loss. What the launcher does (the
restarts, the stalled job's end) runs under real torchrun; the runs whose proof is what the
ranks do -- the reference run, the SIGTERM to one rank and its resumption, the NaN -- run
forked (tests/forked_ranks.py)."""

import random
import subprocess
import sys
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import ROOT, torchrun
from tests.forked_ranks import forked_python, forked_ranks
from meshtrain.training.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 10
DP2_TP2 = ("--parallelism.dp_shard=2", "--parallelism.tp=2")


def args(out, name, *overrides):
    return ["--config", "debug_2d", f"--training.steps={STEPS}", "--training.seq_len=64",
            f"--job.output_dir={out}", f"--job.name={name}", "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--metrics.log_freq=1", *overrides]


def losses(out, name) -> torch.Tensor:
    acc = EventAccumulator(str(out / name / "tb"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == list(range(1, STEPS + 1)), [e.step for e in events]
    return torch.tensor([e.value for e in events])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def uninterrupted(out):
    proc = forked_ranks("train.py", *args(out, "whole", *DP2_TP2), nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(out, "whole")


def test_three_sigkills_under_torchrun_restarts_lose_nothing(out, uninterrupted):
    # Three kills at random steps of random ranks, one per (re)start of the job.
    rng = random.Random()
    steps = sorted(rng.sample(range(3, STEPS), 3))
    plan = ",".join(f"{restart}:{rng.randrange(4)}:{step}" for restart, step in enumerate(steps))
    proc = torchrun("tests/workers/faults.py", "kill", plan, *args(out, "killed", *DP2_TP2), nproc=4,
                    max_restarts=3, timeout=600)
    assert proc.returncode == 0, f"plan {plan}\n" + proc.stderr[-4000:]
    # Each restart resumed from a checkpoint at or before the step its kill came at.
    assert proc.stdout.count("resumed at step") == 3, f"plan {plan}\n" + proc.stdout[-3000:]
    # After each kill the live ranks ended on their own: none waited out torchrun's grace
    # period for its SIGKILL (their hang reports do not wait for a dead rank's record).
    assert "forcefully exiting via 9" not in proc.stderr, f"plan {plan}\n" + proc.stderr[-4000:]
    assert torch.equal(losses(out, "killed"), uninterrupted), f"plan {plan}"


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_then_resumes(out, uninterrupted):
    proc = forked_ranks("tests/workers/faults.py", "sigterm", "1", "5", *args(out, "preempted", *DP2_TP2), nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGTERM received: stopped after step 5; checkpoint saved" in proc.stdout
    assert [s for s, _ in complete_checkpoints(out / "preempted" / "checkpoint")] == [2, 4, 5]
    proc = forked_ranks("train.py", *args(out, "preempted", *DP2_TP2), nproc=4)
    assert proc.returncode == 0 and "resumed at step 5" in proc.stdout
    assert torch.equal(losses(out, "preempted"), uninterrupted)


def test_a_stalled_rank_fails_the_others_within_the_timeout_and_the_hang_report_names_it(out):
    began = time.monotonic()
    proc = torchrun("tests/workers/faults.py", "stall", "1", "3", "600",
                    *args(out, "stalled", *DP2_TP2, "--comm.train_timeout_seconds=5"), nproc=4, timeout=500)
    took = time.monotonic() - began
    assert proc.returncode != 0
    assert "a collective failed during step 3" in proc.stderr, proc.stderr[-3000:]
    assert "another rank died or stalled (train_timeout_seconds = 5)" in proc.stderr
    # Start-up, two steps, the 5 s timeout, then torchrun's grace period before it
    # SIGKILLs the sleeper (which takes SIGTERM as a request to stop after its step).
    assert took < 150, f"took {took:.0f} s for a 5 s timeout (the stall was 600 s)"

    # The hang report: a record from every rank, the stalled one's too (it saw no error:
    # its watchdog wrote it), and a summary naming exactly the rank that stalled.
    hang = out / "stalled" / "hang"
    assert sorted(p.name for p in hang.glob("rank*.txt")) == [f"rank{r}.txt" for r in range(4)], proc.stderr[-3000:]
    summary = (hang / "summary.txt").read_text()
    assert "\nbehind: rank 1\n" in summary, summary
    assert "behind: rank 1\n" in proc.stderr  # printed by the ranks that report the timeout
    stalled = (hang / "rank1.txt").read_text()
    assert "at step 2, after checkpoint save" in stalled, stalled  # it never began step 3
    assert "in before" in stalled and "faults.py" in stalled, stalled  # its stack: the worker's sleep
    # Afterwards, the same answer from the records alone.
    tool = subprocess.run([sys.executable, "-m", "meshtrain.training.hang_report", str(out / "stalled")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "", "PYTHONPATH": str(ROOT)})
    assert tool.returncode == 0 and "\nbehind: rank 1\n" in tool.stdout, tool.stdout + tool.stderr


def _one_process(*argv):
    return forked_python("tests/workers/faults.py", *argv, env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(ROOT)})


def test_a_nan_loss_stops_and_keeps_the_last_good_state(out):
    proc = _one_process("nan", "5", *args(out, "nan_stop", "--parallelism.dp_shard=1", "--parallelism.tp=1",
                                          "--checkpoint.interval=100"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "step 5: loss nan" in proc.stderr and "checkpointed as step 4" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [s for s, _ in complete_checkpoints(out / "nan_stop" / "checkpoint")] == [4]


def test_a_nan_loss_can_be_skipped_and_training_goes_on(out):
    proc = _one_process("nan", "5", *args(out, "nan_skip", "--parallelism.dp_shard=1", "--parallelism.tp=1",
                                          "--training.nonfinite=skip", "--checkpoint.enable=false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 5: loss nan" in proc.stderr and "step skipped (1 of at most 3)" in proc.stderr
    acc = EventAccumulator(str(out / "nan_skip" / "tb"))
    acc.Reload()
    got = [e.value for e in acc.Scalars("loss")]
    assert got[4] != got[4]  # NaN logged for step 5
    assert all(v == v for i, v in enumerate(got) if i != 4) and got[-1] < got[0]
