"""What a long run meets: pre-emption signals, dead or stalled ranks, non-finite numbers.

- `GracefulStop`: SIGTERM / SIGINT (a scheduler's pre-emption, Ctrl-C) only raise a flag;
  at the end of each step every rank learns, with one 4-byte all-reduce, whether *any*
  rank got the signal, so all of them stop after the same step, checkpoint and exit 0 —
  even when the signal reached only some ranks. A second Ctrl-C interrupts at once.
- `set_collective_timeout`: the first step may legitimately be slow (compilation, the
  pipeline's shape inference, a cold file system); after it, a collective that waits
  longer than `train_timeout_seconds` means a rank died or stalled.
- `skip_or_stop`: a step with an inf/NaN loss or gradient norm was not applied; skip it, or
  checkpoint the last good state and stop (`[training] nonfinite`).
- `step_phase` / `CollectiveFailure`: which part of which step a rank was in when a
  collective failed, so the error names it instead of printing a gloo/NCCL stack; with
  the hang report (training/hang_report.py), which ranks are behind and where.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.training import hang_report
from meshtrain.training.hang_report import where


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost its peers; the message says where in the step."""


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was inf/NaN and the policy says stop."""


class GracefulStop:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.received = signum

    def agreed(self, device: torch.device) -> str | None:
        """On every rank: the name of the signal any rank received (None if none did).
        Call it on every rank, at the same point of every step."""
        flag = torch.tensor([float(self.received or 0)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def set_collective_timeout(seconds: float) -> None:
    """Apply ``seconds`` to every process group this rank is in (the mesh's too), and to
    the hang watch's "no progress" (training/hang_report.py) if one runs."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if not str(dist.get_backend(group)).startswith("torchft"):  # its replica group keeps its own timeout
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    if hang_report.current() is not None:
        hang_report.current().timeout = seconds


class step_phase:
    """Where this rank is, for error messages: ``with step_phase(3, "optimizer step"): ...``.
    ``watcher``: set by training/profiling.py inside a profiled window, told each phase's
    start and end (``enter(what)`` / ``exit(what)``); None otherwise, costing nothing.
    Each phase entered and left is also told to the hang report's account of this rank
    (`hang_report.where`: a few attribute stores)."""

    current = "start-up"
    watcher = None

    def __init__(self, step: int, what: str):
        self.step, self.label, self.what = step, f"step {step}, {what}", what

    def __enter__(self):
        step_phase.current = self.label
        where.entered(self.step, self.what)
        if step_phase.watcher is not None:
            step_phase.watcher.enter(self.what)

    def __exit__(self, kind, err, tb):
        if kind is None:  # an error leaving the phase (a timeout) happened inside it: say so
            where.left()
        if step_phase.watcher is not None:
            step_phase.watcher.exit(self.what)
        return False


def is_collective_failure(err: BaseException) -> bool:
    """gloo and NCCL report a peer that died or a wait that timed out as RuntimeError
    (DistBackendError / DistNetworkError are subclasses) with these words."""
    if isinstance(err, (NonFiniteError, CollectiveFailure)):  # ours, whatever words a path in it holds
        return False
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        word in text for word in ("timed out", "timeout", *hang_report.PEER_GONE_WORDS, "peer", "nccl error", "gloo"))


def describe_collective_failure(err: BaseException, timeout: float) -> str:
    """The one-line error, and the hang report's summary below it when a hang watch runs
    (it writes this rank's record and the summary into the run folder's hang/ first)."""
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    line = (f"rank {dist.get_rank() if dist.is_initialized() else 0}: a collective failed during "
            f"{step_phase.current}: another rank died or stalled (train_timeout_seconds = {timeout:g}). "
            f"The newest complete checkpoint is intact; rerun the same command to resume. ({first})")
    watch = hang_report.current()
    if watch is None:
        return line
    try:
        summary = watch.report(err)
    except OSError as why:  # a full or read-only disk must not hide the failure itself
        return f"{line}\n(the hang report could not be written: {why})"
    return f"{line}\n{summary.rstrip()}\n(written to {watch.folder}/summary.txt)"


def skip_or_stop(step: int, loss: float, grad_norm: float, skipped: int, checkpoint, data, t) -> int:
    """A step whose loss or gradient norm is inf/NaN (its update was not applied): count it
    and go on, or keep the last good state and stop. Returns the skipped count."""
    skipped += 1
    if t.nonfinite == "stop" or skipped > t.max_skipped_steps:
        saved = ""
        if checkpoint is not None and step > 1:  # the weights are still those after step - 1
            try:
                checkpoint.save(step - 1, data_state=data.state_dict())
                checkpoint.close()
                saved = f" The last good state is checkpointed as step {step - 1}."
            except NonFiniteError:  # step - 1's own update overflowed: that state is not good either
                saved = (f" The weights after step {step - 1} are not finite either (its update overflowed), so "
                         f"they were not saved; {checkpoint.newest()}.")
        why = "[training] nonfinite = \"stop\"" if t.nonfinite == "stop" else \
            f"{skipped} steps skipped, more than [training] max_skipped_steps = {t.max_skipped_steps}"
        resume = " (to resume a checkpoint at a lower lr, also set [checkpoint] if_config_differs = \"resume\")" \
            if checkpoint is not None else ""
        raise NonFiniteError(f"step {step}: loss {loss}, grad_norm {grad_norm} ({why}).{saved} Lower the learning "
                             f"rate{resume}, check the data, or set nonfinite = \"skip\".")
    if dist.get_rank() == 0:
        print(f"meshtrain: warning: step {step}: loss {loss}, grad_norm {grad_norm}; step skipped "
              f"({skipped} of at most {t.max_skipped_steps})", file=sys.stderr, flush=True)
    return skipped
