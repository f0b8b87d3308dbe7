"""What a failed checkpoint save says: the file system's reason in words, or nothing (a bug).

DCP writes each tensor with torch.save, whose zip writer does not pass on the error of the
write that failed: on a full disk it reports its own bookkeeping, "[enforce fail at
inline_container.cc:...] unexpected pos 704 vs 598", and the OSError with ENOSPC is gone
(seen on a real full tmpfs, sync and async save alike). Such a short write on a disk with
less free space than the save needs is a full disk, and is said as one. An OSError with
an errno (a read-only folder, a quota) is said with the system's words. Anything else is
no fault of the disk: the caller lets it keep its traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

FULL = (errno.ENOSPC, errno.EDQUOT)
SHORT_WRITE = ("unexpected pos", "file write failed")  # torch's zip writer after a failed write


def causes(err: BaseException):
    """``err``, what it was raised from, and each rank's failure inside DCP's
    CheckpointException ({rank: (exception, traceback)}), depth first."""
    seen = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [first for first, _ in (getattr(e, "failures", None) or {}).values()]
        todo += [e.__cause__, e.__context__]


def state_bytes(state: dict) -> int:
    """This rank's bytes of a state dict (its local shards), nested dicts included."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += state_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return total


def free_bytes(folder: Path) -> int | None:
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} bytes" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def describe(err: BaseException, folder: Path, need: int) -> str | None:
    """The reason a save into ``folder`` (``need`` bytes on this rank) failed, in words;
    None when the failure is not the file system's."""
    found = list(causes(err))
    os_error = next((e for e in found if isinstance(e, OSError) and e.errno is not None), None)
    free = free_bytes(folder)
    short = any(any(s in str(e) for s in SHORT_WRITE) for e in found)
    if (os_error is not None and os_error.errno in FULL) or (
            os_error is None and short and free is not None and free < need):
        room = "unknown space" if free is None else _size(free)
        return (f"No space left on device: {room} free in {folder}, and this save needs about {_size(need)} "
                f"per rank; free some space (or lower [checkpoint] keep_latest_k), or set [checkpoint] folder "
                f"on a bigger disk")
    if os_error is not None:
        return f"{os.strerror(os_error.errno)} ({os_error.filename or 'in the checkpoint folder'})"
    return None
