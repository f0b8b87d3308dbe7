"""Independent fake traces at once, one forked process per core.

A traced rank of the collective check, or an activation probe, runs on fake tensors in a
process of its own making (its fake world, its caches) and depends on no other: on a
machine of n cores, n of them run at once. The processes are forked, so they start with
everything the parent has built and imported (importing torch alone takes seconds); only
each item's index goes to a child, only its result comes back (pickled).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

import torch

_work = None  # (fn, items): what a forked child reads, inherited


def default_jobs() -> int:
    """The cores this process may run on, on Linux, when it may fork; one otherwise.
    Forking while another Python thread runs can copy a lock that thread holds (a logging
    handler's, a queue's) into the child, held forever (train.py's start-up signal watcher
    holds none: it waits in a read). macOS's system libraries are not safe to fork, which
    is why Python starts its processes there by spawning (seconds of importing torch)."""
    from meshtrain.training.startup_signals import WATCHER

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name != WATCHER]
    if others or not sys.platform.startswith("linux"):
        return 1
    return len(os.sched_getaffinity(0))


def _run(i: int):
    torch.set_num_threads(1)  # one process per core; fake work gains nothing from a second thread
    fn, items = _work
    return fn(items[i])


def map_forked(fn, items, jobs: int | None = None) -> list:
    """``[fn(x) for x in items]``, in order, over ``jobs`` forked processes (default:
    `default_jobs`; here, one after the other, when that is 1). ``fn`` may be any callable,
    a closure too (the children inherit it); each result must pickle."""
    global _work
    items = list(items)
    jobs = min(default_jobs() if jobs is None else jobs, len(items))
    if jobs <= 1:
        return [fn(x) for x in items]
    _work = (fn, items)
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return pool.map(_run, range(len(items)), chunksize=1)
    finally:
        _work = None
