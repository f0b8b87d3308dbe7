"""Where `meshtrain export` writes: never into the target directly. The export is written
into a temporary folder beside the target (same file system, so the final moves are
renames) and moved into place only once it is complete. A damaged checkpoint, a tensor
missing, a full disk or an interrupt therefore leave an earlier export at the target as
it was -- before, its model.safetensors was deleted first and a traceback followed.

    hf     the target folder is created by renaming the finished one; when it exists (an
           earlier export, perhaps with a tokenizer beside it), each new file replaces its
           namesake by rename, then weight files of the earlier export that the new one
           does not have (other shard counts) are removed. Other files are kept.
    torch  one file, replaced by rename.

What cannot be written is an ExportTargetError naming the path and the fix: a folder given
for the file of --format torch, a file given for the folder of --format hf, a parent that
is a file, a folder that cannot be written (read-only, no permission, full).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

# The weight files of an earlier Hugging Face export (and their index), replaced as a set.
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors")


class ExportTargetError(ValueError):
    """The export's destination cannot take it; the message names the path and the fix."""


def check_target(out: Path, fmt: str) -> None:
    """Refuse a destination of the wrong kind before any tensor is read."""
    if fmt == "torch" and out.is_dir():
        raise ExportTargetError(f"{out} is a folder, and --format torch writes one file: give a file path, "
                                f"e.g. {out / 'model.pt'}")
    if fmt in ("hf", "peft") and out.exists() and not out.is_dir():
        raise ExportTargetError(f"{out} is a file, and --format {fmt} writes a folder (config.json and "
                                f"safetensors): give a folder path, or move the file away")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ExportTargetError(f"{blocking} is a file, so {out} cannot be created under it")


def _cannot_write(out: Path, err: OSError) -> ExportTargetError:
    where = err.filename or out.parent
    reason = os.strerror(err.errno) if err.errno else str(err)
    return ExportTargetError(f"cannot write the export {out}: {reason} ({where}); nothing at {out} was changed. "
                             f"Export to a folder you can write, or free space there")


@contextlib.contextmanager
def staged(out: Path, fmt: str) -> Iterator[Path]:
    """``with staged(out, fmt) as tmp:`` write the export at ``tmp`` (a folder for hf, a
    file for torch); on a clean exit it is moved to ``out``, on any error removed."""
    out = Path(out)
    check_target(out, fmt)
    # Beside where the target really is (a link to a folder on another disk), so that the
    # final moves are renames within one file system.
    tmp = out.resolve().with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)  # an earlier export of this pid that died
        if fmt in ("hf", "peft"):
            tmp.mkdir()
    except OSError as err:
        raise _cannot_write(out, err) from None
    try:
        yield tmp
        if fmt in ("hf", "peft"):
            _swap_folder(tmp, out)
        else:
            os.replace(tmp, out)
    except OSError as err:
        _remove(tmp)
        raise _cannot_write(out, err) from None
    except BaseException:
        _remove(tmp)
        raise


def _swap_folder(tmp: Path, out: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    new = {f.name for f in tmp.iterdir()}
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    for pattern in _WEIGHT_FILES:
        for old in out.glob(pattern):
            if old.name not in new:  # from_pretrained would take a stale single file over a new index
                old.unlink()
    tmp.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
