"""tests/forked_ranks.py, the launcher most multi-process proofs run under: every rank gets
its own RANK in one real gloo world, the script its argv, and a failing rank ends the job
(exit 1, the others stopped) rather than leaving it waiting. A single forked process
(forked_python) answers as `python ...` would: its own environment, argv and exit code."""

import os
import re
import time

import pytest

from tests.forked_ranks import forked_python, forked_ranks

pytestmark = pytest.mark.slow


def test_every_rank_joins_one_gloo_world_with_its_own_rank_and_the_argv():
    proc = forked_ranks("tests/workers/forked_probe.py", "a", "--b=1", nproc=3, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 3 (local {r}): sum 3 argv ['a', '--b=1']" for r in range(3)]


def test_a_failing_rank_fails_the_job_and_stops_the_ranks_waiting_for_it():
    start = time.monotonic()
    proc = forked_ranks("tests/workers/forked_probe.py", nproc=3, timeout=120, env={"FAIL_RANK": "1"})
    assert proc.returncode == 1
    assert "rank 1 fails on purpose" in proc.stderr
    assert time.monotonic() - start < 60  # stopped, not left asleep until the timeout
    pids = [int(pid) for pid in re.findall(r"pid (\d+) sleeps", proc.stdout)]
    assert len(pids) == 2, proc.stdout
    for pid in pids:  # gone, not running on behind the returned job
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_one_forked_process_gets_its_environment_argv_and_exit_code(tmp_path):
    code = "import os, sys; print(os.environ.get('X'), os.environ.get('RANK'), sys.argv[1:], os.getcwd()); sys.exit(3)"
    proc = forked_python("-c", code, "a", env={"X": "y"}, cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (3, f"y None ['a'] {tmp_path}\n"), proc.stderr
    proc = forked_python("-m", "meshtrain.training.hang_report", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr  # SystemExit's code, as python -m
    proc = forked_python("-c", "raise ValueError('planted')")
    assert proc.returncode == 1 and "ValueError: planted" in proc.stderr and "Traceback" in proc.stderr
