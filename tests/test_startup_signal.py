"""SIGTERM while a run is still starting (pre-emption does not wait for the first step):
one line, exit 128 + 15, no traceback, the saved checkpoints intact, and the same command
afterwards resumes as if nothing happened."""

import re
import signal

import pytest

from meshtrain.training.checkpoint import complete_checkpoints
from tests.conftest import ROOT, torchrun
from tests.in_process import tiny_run, train_in_process
from tests.workers import startup_points


def stopped(result) -> str:
    message = result.stderr.strip()
    assert result.code == 128 + signal.SIGTERM, (result.code, result.stdout[-1500:], message[-1500:])
    assert message.startswith("meshtrain: error: stopped by SIGTERM during start-up")
    assert message.count("\n") == 0 and "Traceback" not in message, message
    return message


def test_sigterm_at_each_moment_of_start_up_ends_with_one_line_and_resumes_after(tmp_path, monkeypatch):
    assert train_in_process(*tiny_run(tmp_path, "run", "--training.steps=2")).code == 0
    folder = tmp_path / "run" / "checkpoint"
    saved = {p.name: sorted(f.name for f in p.iterdir()) for _, p in complete_checkpoints(folder)}
    for point in startup_points.POINTS:
        with monkeypatch.context() as m:
            startup_points.signal_at(point, setattr=m.setattr)
            stopped(train_in_process(*tiny_run(tmp_path, "run", "--training.steps=4")))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run put the handler back
        assert {p.name: sorted(f.name for f in p.iterdir()) for _, p in complete_checkpoints(folder)} == saved
    resumed = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=4"))
    assert resumed.code == 0 and "resumed at step 2" in resumed.stdout, resumed.stderr[-2000:]
    assert [s for s, _ in complete_checkpoints(folder)] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["config", "run_dir"])
def test_sigterm_to_one_rank_during_start_up_stops_the_job_without_a_traceback(tmp_path, point):
    # Rank 1 is signalled before torch is imported, or just after the process group is up;
    # torchrun then stops rank 0, wherever it is in its own start-up.
    proc = torchrun("tests/workers/faults.py", "sigterm_startup", "1", point, "--config", "debug_2d",
                    "--parallelism.tp=1", "--parallelism.dp_shard=2", "--training.steps=2",
                    "--training.seq_len=16", f"--job.output_dir={tmp_path}", "--job.name=run", nproc=2,
                    timeout=240)
    assert proc.returncode != 0
    assert "meshtrain: error: stopped by SIGTERM during start-up" in proc.stderr, proc.stderr[-3000:]
    # No rank needed torchrun's SIGKILL: at "config" rank 0's SIGTERM (from torchrun) finds it
    # blocked in the rendezvous, waiting for rank 1, where Python never runs a handler;
    # torchrun would kill it 30 s later (exit code -9 in its report) without a word.
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.stderr, re.MULTILINE)
    assert len(codes) == 2 and "-9" not in codes, proc.stderr[-3000:]
    # Frames of our files; not torch's, wherever it is installed (a .venv inside the checkout).
    ours = [line for line in proc.stderr.splitlines()
            if 'File "' in line and str(ROOT) in line and "site-packages" not in line]
    assert not ours, proc.stderr[-3000:]  # torchrun's own report may have a traceback; no frame of ours


@pytest.mark.slow  # a process of its own
def test_a_signal_during_a_dry_run_ends_it_where_it_is_with_the_one_line():
    # The fake traces run mostly inside torch's C++, where an exception raised by the
    # handler can land in a callback that may not throw (the process then aborts, exit
    # 134). There the handler ends the process itself: the running code sees no exception.
    import subprocess
    import sys

    script = """
import os, signal, sys
from meshtrain import train
from meshtrain.planning import dry_run as planning_dry_run

def signalled_mid_trace(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**7):
            pass  # the handler runs between bytecodes, here
    except BaseException as seen:
        print("the trace saw", type(seen).__name__, flush=True)
        raise
    print("the trace ran on", flush=True)

planning_dry_run.dry_run = signalled_mid_trace
sys.exit(train.run(["--config", "debug_2d", "--dry-run", "--world-size", "4"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == ""  # neither an exception in the trace nor a trace that went on
    assert proc.stderr.strip().startswith("meshtrain: error: stopped by SIGTERM during start-up")
    assert "Traceback" not in proc.stderr


def test_a_signal_while_a_rank_says_its_error_does_not_interrupt_it(monkeypatch, capsys):
    # One rank refuses a layout and ends; torchrun then sends SIGTERM to the others, which may
    # be saying the same error at that moment. Each must still end with its own one line and
    # exit code, not with a traceback of the signal raised inside its error handling.
    import os

    from meshtrain import train
    from meshtrain.parallel import LayoutError

    def refused(argv):
        raise LayoutError("pp*dp_replicate*dp_shard*tp = 6, but the world size is 4")

    monkeypatch.setattr(train, "tell_torchrun", lambda message: os.kill(os.getpid(), signal.SIGTERM))
    assert train.run([], command=refused) == 2
    err = capsys.readouterr().err
    assert err == "meshtrain: error: pp*dp_replicate*dp_shard*tp = 6, but the world size is 4\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
