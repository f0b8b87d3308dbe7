"""One run per folder. Two jobs writing the same `output_dir/name` would delete each
other's checkpoint `.tmp` folders and interleave their TensorBoard events, so rank 0 of a
run holds `run.lock` there (host, pid, start time) from start-up to exit, and a second job
is refused at once. The checkpoint folder gets a lock of its own, since `[checkpoint]
folder` may lie outside the run folder (an absolute path on shared storage): two runs with
different run folders but one checkpoint folder would each resume and prune the other's
steps. A lock left by a run that died -- its pid gone on this host, as after a
SIGKILL or before a torchrun restart -- is taken over. A lock held from another host
cannot be checked and is refused, saying how to clear it.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

from meshtrain.training.config import ConfigError

LOCK_NAME = "run.lock"


def acquire(folder: Path, *, run_dir: Path | None = None, key: str | None = None) -> Path:
    """Take ``folder``'s lock for this process (released at exit), or raise ConfigError
    naming the run that holds it. ``run_dir``: the run this lock is taken for, when the
    folder is not the run folder itself (recorded, so a refusal can name it); ``key``: the
    config key that names the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
          "run_dir": str(run_dir or folder)}
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # atomic: one creator wins
        except FileExistsError:
            holder = _read(lock)
            ours = holder is not None and holder["pid"] == me["pid"] and holder["host"] == me["host"]
            if holder is not None and not ours and not _dead(holder, me["host"]):
                raise ConfigError(_refusal(folder, lock, holder, key)) from None
            lock.unlink(missing_ok=True)  # a dead run's, an unreadable, or an earlier run's of this process
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
        atexit.register(release, lock, me["pid"])
        return lock


def release(lock: Path, pid: int) -> None:
    holder = _read(lock)
    if holder is not None and holder.get("pid") == pid and holder.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def _read(lock: Path) -> dict | None:
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and {"host", "pid", "started"} <= set(holder) else None


def _dead(holder: dict, host: str) -> bool:
    if holder["host"] != host:
        return False  # another machine's process: no way to ask, so assume it runs
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _refusal(folder: Path, lock: Path, holder: dict, key: str | None) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    who = f"pid {holder['pid']} on {holder['host']}, since {since}"
    if key is None:
        return (f"{folder} is in use by another run ({who}); two runs in one folder would delete each other's "
                f"checkpoints. Wait for it, or set [job] name / output_dir to another folder; if that run is "
                f"gone, delete {lock}")
    return (f"{key} = {folder} is in use by the run in {holder.get('run_dir', 'another folder')} ({who}); two "
            f"runs saving into one folder would resume and prune each other's checkpoints. Give this run a "
            f"{key} of its own, or wait for that run; if it is gone, delete {lock}")
