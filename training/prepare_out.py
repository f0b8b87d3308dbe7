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

import errno
import os
import re
import shutil
from pathlib import Path

import numpy as np

from meshtrain.training.config import ConfigError

# Everything prepare-data writes: token shards and their progress file, sft arrays, the
# index, and the .tmp each is written to first.
OURS = re.compile(r"^(index\.json|index\.tmp|prepare\.json|prepare\.tmp|shard_\d{5,}\.bin"
                  r"|tokens\.bin|mask\.bin|offsets\.bin)(\.tmp)?$")
INDEX, PROGRESS = "index.json", "prepare.json"


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
    names = sorted(p.name for p in out_dir.iterdir())
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
    except OSError as err:
        if own:
            Path(path).unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(path)) from None


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
