"""A checkpoint save on a full disk says so, with the folder and its free space, whether
the disk's error reaches us (an OSError) or only torch's zip writer's words about it;
any other failure keeps its traceback."""

import contextlib
import errno
import io
import os

import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.api import CheckpointException

from meshtrain.training import save_failure
from meshtrain.training.checkpoint import complete_checkpoints
from tests.in_process import refused, tiny_run, train_in_process

# What torch 2.13's DCP raised on a real full tmpfs (1 MiB), sync and async save alike.
SEEN = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def test_torchs_short_write_on_a_disk_without_room_is_no_space_left(tmp_path):
    err = CheckpointException("write", {0: (RuntimeError(SEEN), [])})
    free = save_failure.free_bytes(tmp_path)
    said = save_failure.describe(err, tmp_path, need=free + 1)
    assert said.startswith("No space left on device: ") and f"free in {tmp_path}" in said
    assert save_failure.describe(err, tmp_path, need=0) is None  # room enough: not the disk, a traceback
    assert save_failure.describe(RuntimeError("a bug"), tmp_path, need=free + 1) is None
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS), "x.distcp")
    assert save_failure.describe(read_only, tmp_path, need=0) == "Read-only file system (x.distcp)"


class FullDisk(io.RawIOBase):
    """A file on a disk with no room left: every write fails with ENOSPC."""

    def __init__(self, real):
        super().__init__()
        self.real = real

    def writable(self):
        return True

    def tell(self):
        return self.real.tell()

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))



def test_async_save_on_a_full_disk_names_the_folder_and_free_space(tmp_path, monkeypatch):
    real = dcp_fs.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):  # the disk fills up after the first checkpoint
        with real(self, path, mode) as stream:
            yield stream if "step-00000001" in str(path) else FullDisk(stream)

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    result = train_in_process(*tiny_run(tmp_path, "run", "--checkpoint.async_save=true", "--training.steps=4"))
    message = refused(result)
    folder = tmp_path / "run" / "checkpoint"
    assert "saving" in message and "step-00000002" in message
    assert "No space left on device" in message and f"free in {folder}" in message
    assert "unexpected pos" not in message and "step-00000001" in message  # what is intact
    assert [s for s, _ in complete_checkpoints(folder)] == [1]
