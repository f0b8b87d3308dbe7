"""planning/forked.py: independent fake traces (the collective check's ranks, the layout
search's activation probes and layouts) run one forked process per core and give what
running them one after the other gives."""

import multiprocessing
import os
import signal
import time

import pytest

from meshtrain.physics.gpus import get_gpu
from meshtrain.planning import activations, forked, search
from meshtrain.planning.forked import map_forked
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import Job


def test_each_result_comes_back_in_order_from_the_forked_processes():
    parent = os.getpid()
    offset = 10  # a closure: the children inherit it, nothing of it is pickled
    out = map_forked(lambda x: (x + offset, os.getpid()), range(7), jobs=2)
    assert [v for v, _ in out] == list(range(10, 17))
    assert parent not in {pid for _, pid in out}
    assert {pid for _, pid in map_forked(lambda x: (x, os.getpid()), range(3), jobs=1)} == {parent}


def test_no_fork_while_another_python_thread_runs():
    # A fork copies whatever lock another thread holds at that moment, held for good in the
    # child: with another thread alive the work stays in this process.
    import threading

    alone = [threading.main_thread()]  # as in `meshtrain check`: the main thread (and the signal watcher)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(forked.threading, "enumerate", lambda: alone)
        assert forked.default_jobs() == len(os.sched_getaffinity(0))
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert forked.default_jobs() == 1
        assert {pid for _, pid in map_forked(lambda x: (x, os.getpid()), range(3))} == {os.getpid()}
    finally:
        release.set()
        other.join()


def test_a_pools_worker_forks_no_processes_of_its_own():
    """`plan --verify` dry-runs layouts in a pool's workers, and a dry run may fork (a
    pipeline rank's stages, planning/stages_apart.py): a pool's worker is daemonic, and
    multiprocessing refuses it children, so there the work stays in the worker."""
    assert map_forked(lambda _: forked.default_jobs(), range(2), jobs=2) == [1, 1]


@pytest.mark.slow
def test_the_layout_search_judges_in_forked_processes_what_it_judges_in_one(monkeypatch, tmp_path):
    # The debug Llama on 4 GPUs: 272 candidate layouts, in 17 pieces of 16.
    job = Job(resolve_model("debug"), get_gpu("h100-80gb"), nodes=1, gpus_per_node=4, seq_len=1024,
              global_batch=32)
    monkeypatch.setattr(search, "PIECE", 16)
    judge, seen = search._judge, tmp_path / "pids"

    def noting_the_process(*args):
        with open(seen, "a") as f:
            f.write(f"{os.getpid()}\n")
        return judge(*args)

    monkeypatch.setattr(search, "_judge", noting_the_process)
    monkeypatch.setattr(forked, "default_jobs", lambda: 1)
    one = search.plan(job)
    assert set(seen.read_text().split()) == {str(os.getpid())}
    seen.unlink()
    monkeypatch.setattr(forked, "default_jobs", lambda: 2)
    several = search.plan(job)
    assert str(os.getpid()) not in set(seen.read_text().split())  # every layout judged in a child
    assert len(one[0]) > 100 and one[0] == several[0]  # the same estimates, in the same order
    assert one[1:] == several[1:]


def test_activation_probes_traced_in_forked_processes_come_back_whole(monkeypatch):
    keys = [activations.ProbeKey("llama", "debug", 256, seq_len=128, tp=tp) for tp in (1, 2)]
    monkeypatch.setattr(activations, "_profiles", {})
    activations.trace_probes(keys, jobs=1)
    here = dict(activations._profiles)
    monkeypatch.setattr(activations, "_profiles", {})
    activations.trace_probes(keys + [None], jobs=2)  # None: a model without a probe, skipped
    assert activations._profiles == here and len(here) == 2
    assert here[keys[0]] != here[keys[1]]  # a child tracing the wrong key would show


def test_a_forked_child_takes_signals_itself_not_through_the_start_up_watcher():
    # train.py's start-up handler sends signals through a pipe to a watcher thread that ends
    # the process if the main thread seems blocked. A forked child has no watcher: left as
    # is, the child's SIGTERM (the pool ending it) would reach the parent's watcher.
    from meshtrain.training import startup_signals

    previous = startup_signals.install(on_blocked=lambda stop: None)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            handler, wakeup = pool.apply(_signal_state)
        assert (handler, wakeup) == (signal.SIG_DFL, -1)
        assert signal.getsignal(signal.SIGTERM) is startup_signals._handle  # the parent keeps its own
    finally:
        startup_signals.restore(previous)


def _signal_state():
    wakeup = signal.set_wakeup_fd(-1)
    return signal.getsignal(signal.SIGTERM), wakeup


def test_work_started_later_runs_beside_the_caller_and_gives_its_value_or_its_error(monkeypatch, tmp_path):
    from meshtrain.parallel import LayoutError

    monkeypatch.setattr(forked, "default_jobs", lambda: 2)
    with forked.later(lambda: os.getpid()) as result:
        assert result() != os.getpid()

    def refused():
        raise LayoutError("tp=16 is more than the 8 GPUs of a node")

    with forked.later(refused) as result:
        with pytest.raises(LayoutError, match="tp=16 is more than") as raised:
            result()
    # bad input keeps its one message; a bug would show where in the child it was raised
    assert isinstance(raised.value.__cause__, forked.ChildTraceback)
    assert "in refused" in str(raised.value.__cause__)

    monkeypatch.setattr(forked, "default_jobs", lambda: 1)  # may not fork: run when asked, here
    with forked.later(lambda: os.getpid()) as result:
        assert result() == os.getpid()


@pytest.mark.timeout(30)  # without the kill, leaving the block would wait out the child's hour
def test_work_started_later_ends_when_the_caller_fails_first(monkeypatch, tmp_path):
    monkeypatch.setattr(forked, "default_jobs", lambda: 2)
    started = tmp_path / "pid"

    def an_hour():
        (tmp_path / "writing").write_text(str(os.getpid()))
        (tmp_path / "writing").rename(started)  # whole, or not there
        time.sleep(3600)

    with pytest.raises(KeyError):
        with forked.later(an_hour):
            while not started.exists():
                time.sleep(0.01)
            raise KeyError("the caller's own error")
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.read_text()), 0)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # ended, not yet reaped by whoever adopted it
    except FileNotFoundError:
        return True


@pytest.mark.slow  # a process of its own, importing torch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["later", "map_forked"])
def test_forked_processes_end_when_their_parent_is_killed(tmp_path, how):
    # SIGKILL (or an abort) runs no clean-up in the parent: the kernel ends the children.
    import subprocess
    import sys

    started = tmp_path / "pid"
    run = ("with forked.later(an_hour):\n    time.sleep(3600)" if how == "later" else
           "forked.map_forked(lambda i: an_hour(), [0, 1], jobs=2)")
    script = f"""
import os, time
from meshtrain.planning import forked
forked.default_jobs = lambda: 2
def an_hour():
    writing = {str(tmp_path)!r} + f"/writing-{{os.getpid()}}"  # each child its own, then one of them whole
    open(writing, 'w').write(str(os.getpid()))
    os.rename(writing, {str(started)!r})
    time.sleep(3600)
{run}
"""
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        while not started.exists():
            assert parent.poll() is None, "the parent ended before its child started"
            time.sleep(0.05)
        child = int(started.read_text())
        assert not _gone(child) and child != parent.pid
    finally:
        parent.kill()
        parent.wait()
    waited = time.monotonic()
    while not _gone(child) and time.monotonic() - waited < 10:
        time.sleep(0.05)
    assert _gone(child)
