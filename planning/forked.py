"""Independent fake traces at once, one forked process per core.

A traced rank of the collective check, or an activation probe, runs on fake tensors in a
process of its own making (its fake world, its caches) and depends on no other: on a
machine of n cores, n of them run at once. The processes are forked, so they start with
everything the parent has built and imported (importing torch alone takes seconds); only
each item's index goes to a child, only its result comes back (pickled). `later` runs one
piece of work in a forked process while the caller goes on with another.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from contextlib import contextmanager

import torch

_work = None  # (fn, items): what a forked child reads, inherited


def default_jobs() -> int:
    """The cores this process may run on, on Linux, when it may fork; one otherwise.
    Forking while another Python thread runs can copy a lock that thread holds (a logging
    handler's, a queue's) into the child, held forever (train.py's start-up signal watcher
    holds none: it waits in a read). macOS's system libraries are not safe to fork, which
    is why Python starts its processes there by spawning (seconds of importing torch).
    And a pool's worker (`map_forked`'s: `plan --verify` dry-runs layouts in them) is a
    daemonic process, which multiprocessing does not let have children of its own."""
    from meshtrain.training.startup_signals import WATCHER

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name != WATCHER]
    if others or not sys.platform.startswith("linux") or multiprocessing.current_process().daemon:
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
    _flush()
    _work = (fn, items)
    try:
        with multiprocessing.get_context("fork").Pool(jobs, initializer=_end_with, initargs=(os.getpid(),)) as pool:
            return pool.map(_run, range(len(items)), chunksize=1)
    finally:
        _work = None


def _flush() -> None:
    # A forked child inherits what this process has not yet written and writes it again
    # when it exits (multiprocessing flushes a child's standard streams): a line twice.
    sys.stdout.flush()
    sys.stderr.flush()


class ChildTraceback(Exception):
    """Where an exception raised in a forked process came from: its traceback, as text
    (the frames themselves cannot cross). Re-raised here from it, a bug shows both."""


def _end_with(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` ends, however it ends (a signal
    it cannot handle, an abort), so no trace runs on orphaned (Linux: PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def _send_result(fn, send, parent: int) -> None:
    _end_with(parent)
    torch.set_num_threads(1)
    try:
        out = ("returned", fn(), None)
    except BaseException as err:  # to the parent, which raises it
        out = ("raised", err, traceback.format_exc())
    send.send(out)
    send.close()


@contextmanager
def later(fn):
    """Yields ``result``, a function returning ``fn()``: fn starts now in a forked process,
    and ``result()`` waits for it (raising what fn raised), while the caller does other
    work; where this process may not fork (`default_jobs` is 1), fn runs at that call, here.
    Leaving the block ends the process if it still runs (the caller failed first)."""
    if default_jobs() <= 1:
        yield fn
        return
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    _flush()
    child = ctx.Process(target=_send_result, args=(fn, send, os.getpid()), daemon=False)  # it may fork ranks of its own
    child.start()
    send.close()

    def result():
        try:
            status, value, text = receive.recv()
        except EOFError:  # killed, or its result would not pickle (said on its stderr)
            child.join()
            raise RuntimeError(f"the forked process ended without a result (exit code {child.exitcode})") from None
        child.join()
        if status == "raised":
            raise value from ChildTraceback(text)
        return value

    try:
        yield result
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
