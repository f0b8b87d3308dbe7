"""planning/forked.py: independent fake traces (the collective check's ranks, the layout
search's activation probes and layouts) run one forked process per core and give what
running them one after the other gives."""

import multiprocessing
import os
import signal

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
