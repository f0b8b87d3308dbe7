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
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


def _handle(signum, frame) -> None:
    if _State.fired:  # a second signal while the first one unwinds: let the exit finish
        return
    _State.fired = True
    raise StoppedBySignal(signum, _State.phase)


def phase() -> str:
    """"start-up" until the training loop is over, then "shut-down"."""
    return _State.phase


def training_over() -> None:
    """From now on a signal interrupts the shut-down, not the start-up (words only)."""
    _State.phase = "shut-down"


def install() -> dict:
    """The start-up handler for SIGTERM and SIGINT (main thread only); returns the previous
    handlers for `restore`."""
    _State.fired, _State.phase = False, "start-up"
    try:
        return {sig: signal.signal(sig, _handle) for sig in SIGNALS}
    except ValueError:  # not the main thread (a test's runner): signals go elsewhere anyway
        return {}


def restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
