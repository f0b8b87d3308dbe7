"""What a user sees from train.py: one line per save and at the end, one memory figure per
step, a rerun of a finished job that says there is nothing to do, a new run that gets its
own TensorBoard curve, and a hint with the launch command when the world does not fit."""

import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import torchrun
from tests.forked_ranks import forked_python

pytestmark = pytest.mark.slow  # every test here starts processes

ONE_PROCESS = ("--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", "--training.steps=4")


def train(out, *args):
    proc = forked_python("train.py", *ONE_PROCESS, f"--job.output_dir={out}", *args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def losses(folder):
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("loss")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One 4-step run that saved steps 2 and 4, trained once for the module: (its folder, what it printed)."""
    out = tmp_path_factory.mktemp("finished")
    return out / "debug_2d", train(out, "--checkpoint.enable=true", "--checkpoint.interval=2")


def test_saves_and_the_end_are_said_and_a_finished_job_has_nothing_to_do(finished, tmp_path):
    run, first = finished
    saves = [line for line in first.splitlines() if line.startswith("meshtrain: saved step")]
    assert [line.split()[3] for line in saves] == ["2", "4"], first
    assert "step-00000004" in saves[-1]
    done = first.splitlines()[-1]
    assert done.startswith("meshtrain: done: steps 1-4") and "final loss" in done, first
    assert "checkpoint" in done and "tensorboard --logdir" in done
    step_lines = [line for line in first.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 4 and all(line.count("GiB") == 1 for line in step_lines), step_lines

    shutil.copytree(run, tmp_path / run.name)  # the run folder as the finished job left it
    again = train(tmp_path, "--checkpoint.enable=true")
    assert "nothing to do" in again and "step 4" in again and "--training.steps 8" in again, again
    assert not any(line.startswith("step ") for line in again.splitlines())
    assert "done:" not in again


def test_a_new_run_in_a_used_folder_gets_its_own_tensorboard_curve(finished, tmp_path):
    shutil.copytree(finished[0], tmp_path / "debug_2d")  # a folder a 4-step run has used
    tb = tmp_path / "debug_2d" / "tb"
    before = losses(tb)
    second = train(tmp_path, "--optimizer.lr=3e-3")  # a different run: a different curve
    earlier = [p for p in tb.iterdir() if p.is_dir() and p.name.startswith("earlier-")]
    assert len(earlier) == 1 and str(earlier[0]) in second, second
    assert losses(earlier[0]) == before                # the first curve, kept whole and apart
    now = losses(tb)
    assert sorted(now) == [1, 2, 3, 4] and now[4] != before[4]  # each step once: not drawn over


def test_a_world_that_does_not_fit_the_degrees_names_the_launch_command(tmp_path):
    proc = forked_python("train.py", "--config", "debug_2d", f"--job.output_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "meshtrain train --nproc-per-node 4" in proc.stderr and "--world-size 4" in proc.stderr
    dry = forked_python("train.py", "--config", "debug_2d", "--dry-run", timeout=120)
    assert dry.returncode == 2 and "--world-size 4" in dry.stderr, dry.stderr


def test_torchrun_reports_our_message_as_the_root_cause(tmp_path):
    # torchrun's own ChildFailedError report ends the screen; its root cause is our line,
    # not a link about enabling tracebacks.
    proc = torchrun("train.py", "--config", "debug_2d", f"--job.output_dir={tmp_path}", nproc=2, timeout=120)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "traceback : meshtrain: error: parallel degrees do not multiply" in root_cause, proc.stderr[-3000:]
