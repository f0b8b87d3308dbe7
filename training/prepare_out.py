"""The output folder of training/prepare_data.py: whose files are in it, and writing them.

prepare-data writes only into a folder that is new, empty, or one it wrote itself. A
folder holding a complete dataset of other inputs or settings, or an unfinished one, is
replaced only when `--overwrite` says so, and then only the files prepare-data writes are
removed; a folder holding anything else is refused whatever the flags (it is somebody's
work). Writes go through `write_all`, so a failure names the file it was writing and
leaves no half-written file behind; a full disk is said in words with the free space
(`PrepareFailure`), and index.json -- what makes a folder a dataset -- is only ever
written last.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import numpy as np

from meshtrain.training.config import ConfigError

# Everything prepare-data writes: token shards and their progress file, sft arrays, the
# index, and the .tmp each is written to first.
OURS = re.compile(r"^(index\.json|index\.tmp|prepare\.json|prepare\.tmp|prepare\.lock|shard_\d{5,}\.bin"
                  r"|tokens\.bin|mask\.bin|offsets\.bin)(\.tmp)?$")
INDEX, PROGRESS, LOCK = "index.json", "prepare.json", "prepare.lock"


class PrepareFailure(Exception):
    """The preparation could not go on (a full disk, a killed worker); the message says what
    is kept and how to go on."""


def check_out(out_dir: Path, *, overwrite: bool, same_plan) -> None:
    """Refuse (ConfigError) an --out that is a file, holds others' files, or holds another
    preparation; with ``overwrite``, remove that preparation's files. ``same_plan()``: True
    when the folder's prepare.json is this command's own (a rerun resumes or is done)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder; name a new folder for the shards "
                          f"and index.json (nothing was changed)")
    if not out_dir.is_dir():
        return
    names = sorted(p.name for p in out_dir.iterdir() if p.name != LOCK)
    others = [n for n in names if not OURS.match(n)]
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(f"--out {out_dir} holds files prepare-data did not write ({shown}); choose a new "
                          f"or empty folder (nothing was changed)")
    if not names or same_plan():
        return
    what = ("a complete prepared dataset" if INDEX in names else
            "an unfinished preparation (no index.json yet)")
    if not overwrite:
        raise ConfigError(f"--out {out_dir} already holds {what} of other inputs or settings; pass "
                          f"--overwrite to replace it, or choose another folder (nothing was changed)")
    (out_dir / INDEX).unlink(missing_ok=True)  # first: a folder without it is not a dataset
    for name in names:
        (out_dir / name).unlink(missing_ok=True)


@contextlib.contextmanager
def claimed(out_dir: Path):
    """One preparer per folder: ``prepare.lock`` (host, pid) while the block runs. Two
    preparers writing one folder would interleave their shards. A lock whose process is gone
    from this host (a kill -9) is taken over. A folder this made and left empty is removed."""
    from meshtrain.training import run_lock  # its checks of a holder: the same rules as a run's lock

    if out_dir.exists() and not out_dir.is_dir():
        yield  # check_out says what is wrong
        return
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    lock, me = out_dir / LOCK, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    try:
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                holder = run_lock._read(lock)
                if holder is not None and holder["pid"] != me["pid"] and not run_lock._dead(holder, me["host"]):
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
                    raise ConfigError(f"--out {out_dir} is being prepared by pid {holder['pid']} on "
                                      f"{holder['host']} since {since}; two preparers in one folder would mix their "
                                      f"shards. Wait for it, or choose another --out; if it is gone, delete {lock}")
                lock.unlink(missing_ok=True)
        write_all(lock, json.dumps(me).encode(), fd)
        os.close(fd)
        yield
    finally:
        run_lock.release(lock, me["pid"])
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()


def write_all(path: Path, data, fd: int | None = None) -> None:
    """Write ``data`` (bytes or an array) to ``path`` (or to the open ``fd``, appending);
    an OSError names ``path``, and a new file is removed when its write fails."""
    view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
    own = fd is None
    try:
        if own:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while view:
                view = view[os.write(fd, view):]
        finally:
            if own:
                os.close(fd)
    except BaseException as err:  # a full disk, or Ctrl-C: no half-written file is left
        if own:
            Path(path).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


def describe_os_error(err: OSError, out_dir: Path, kept: str) -> str:
    """One line for an OSError of the preparation: a full disk with the free space, or the
    system's words and the file."""
    where = err.filename or out_dir
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free(out_dir)
        return (f"no space left on device writing {where} ({free} free in {out_dir}); free some space or "
                f"choose an --out on a bigger disk. {kept}")
    return f"{os.strerror(err.errno) if err.errno else err} ({where}). {kept}"


def _free(folder: Path) -> str:
    path = folder
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown space"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:,} bytes" if unit == "bytes" else f"{free:,.1f} {unit}"
        free /= 1024
    return ""
