"""SIGTERM / SIGINT before training's own handler (faults.GracefulStop) is in place.

A job is pre-empted or cancelled at any moment, start-up included: importing torch, the
process group's rendezvous, building and initializing the model, opening the checkpoint
take seconds to minutes. Python's default SIGTERM kills the process on the spot (torchrun
then reports "Signal 15" for it); SIGINT raises KeyboardInterrupt with a traceback from
wherever the rank was. `install` runs first thing in `train.run`, before any heavy
import: a signal that arrives before the training loop ends the rank with one line and
exit code 128 + the signal's number. There is nothing to save yet and nothing was
written that a rerun would not redo (the run lock is released with the process).
GracefulStop replaces the handler for the training loop, where a stop waits for the
step and checkpoints.

A Python handler only runs between bytecodes: a rank blocked in C -- waiting at the
process group's rendezvous for a rank that was stopped before reaching it -- would not
see its SIGTERM, and torchrun kills it 30 s later (SIGKILL, no message). A watcher thread
reads the signal numbers Python's C handler writes to a wakeup pipe; if the start-up
handler has not run `BLOCKED_GRACE` seconds later, the main thread is stuck in C, and the
watcher ends the rank itself with the same one line and exit code.
"""

from __future__ import annotations

import os
import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
BLOCKED_GRACE = 2.0  # seconds: a main thread running Python takes microseconds to handle a signal
WATCHER = "meshtrain-startup-signals"  # the watcher thread's name; it holds no lock, so a fork may copy it


class StoppedBySignal(BaseException):
    """Raised by the handler. A BaseException, like KeyboardInterrupt: code that catches
    Exception to report bad input must not take it for one."""

    def __init__(self, signum: int, phase: str):
        self.signum = signum
        name = signal.Signals(signum).name
        if phase == "start-up":
            super().__init__(f"stopped by {name} during start-up, before any step was trained: nothing was saved "
                             f"and nothing saved before was touched; run the same command again to start (or "
                             f"resume)")
        else:
            super().__init__(f"stopped by {name} while shutting down, after training; the checkpoints already "
                             f"complete are intact")


class _State:
    phase = "start-up"
    fired = False
    at_once = False  # `end_at_once`: the handler ends the process itself
    on_blocked = None  # called with the StoppedBySignal when the main thread cannot raise it
    wakeup = None      # the pipe's write end, once the watcher runs


def _handle(signum, frame) -> None:
    if _State.fired:  # a second signal while the first one unwinds: let the exit finish
        return
    _State.fired = True
    stop = StoppedBySignal(signum, _State.phase)
    if _State.at_once and _State.on_blocked is not None:
        _State.on_blocked(stop)  # does not return
    raise stop


def phase() -> str:
    """"start-up" until the training loop is over, then "shut-down"."""
    return _State.phase


def training_over() -> None:
    """From now on a signal interrupts the shut-down, not the start-up (words only)."""
    _State.phase = "shut-down"


def ending() -> None:
    """This process is already ending with its own message and exit code: a signal now
    (torchrun's SIGTERM to the other ranks once one has failed) is let be, as a second one
    is, rather than raised into the code saying that message."""
    _State.fired = True


def end_at_once() -> None:
    """From now on the handler ends the process itself (``on_blocked``: the same line and
    exit code) instead of raising StoppedBySignal into whatever runs. For the fake traces
    (the dry run, the hang check), which have nothing to unwind and run mostly inside
    torch's C++: there the exception can surface in a Python callback of C++ code that may
    not throw, and the process aborts ("terminate called after throwing an instance of
    'python_error'", exit 134, seen in about one SIGTERM of ten during a 405B dry run)."""
    _State.at_once = True


def install(on_blocked=None) -> dict:
    """The start-up handler for SIGTERM and SIGINT (main thread only); returns the previous
    handlers for `restore`. ``on_blocked(stop)``: what to do when the signal arrives while
    the main thread is blocked in C code -- say ``stop`` and end the process (it must not
    return)."""
    _State.fired, _State.phase, _State.on_blocked, _State.at_once = False, "start-up", on_blocked, False
    try:
        previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS}
    except ValueError:  # not the main thread (a test's runner): signals go elsewhere anyway
        return {}
    if on_blocked is not None:
        if _State.wakeup is None:
            read, _State.wakeup = os.pipe()
            os.set_blocking(_State.wakeup, False)
            threading.Thread(target=_watch, args=(read,), name=WATCHER, daemon=True).start()
        signal.set_wakeup_fd(_State.wakeup, warn_on_full_buffer=False)
    return previous


def _watch(read: int) -> None:
    while True:
        signum = os.read(read, 1)[0]
        if signum not in SIGNALS:
            continue
        time.sleep(BLOCKED_GRACE)
        # Still the start-up handler, and it never ran: the main thread is blocked in C.
        if (not _State.fired and _State.phase == "start-up" and _State.on_blocked is not None
                and signal.getsignal(signum) is _handle):
            _State.fired = True
            _State.on_blocked(StoppedBySignal(signum, "start-up"))


def _forked_child() -> None:
    """A forked child (the collective check's tracing processes) has no watcher: its signals
    take their default action instead of writing to the parent's pipe, whose watcher would
    take the parent for blocked and end it."""
    if _State.wakeup is None and _State.on_blocked is None:
        return
    _State.on_blocked = None
    for sig in SIGNALS:
        if signal.getsignal(sig) is _handle:
            signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forked_child)


def restore(previous: dict) -> None:
    _State.on_blocked, _State.at_once = None, False
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if previous and _State.wakeup is not None:
        signal.set_wakeup_fd(-1)
