"""Run train.py and die abruptly around a checkpoint, as a crashed or killed job would:

    torchrun ... tests/workers/crash_in_checkpoint.py after-save STEP [train.py args]
        every rank exits (os._exit, no clean-up) once the checkpoint of STEP is complete
    torchrun ... tests/workers/crash_in_checkpoint.py mid-save STEP [train.py args]
        rank 1 SIGKILLs itself in the middle of writing STEP's checkpoint: its shard is on
        disk, the checkpoint's metadata never will be

The save itself is the real one; only the moment of death is chosen.
"""

import os
import signal
import sys


import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from meshtrain import train
from meshtrain.training.checkpoint import CheckpointManager

mode, step = sys.argv[1], int(sys.argv[2])

if mode == "after-save":
    real_save = CheckpointManager.save

    def save_then_die(self, at, **kwargs):
        real_save(self, at, **kwargs)
        if at == step:
            self.finish_pending()
            dist.barrier()  # rank 0 has renamed the folder: the checkpoint is complete
            os._exit(17)

    CheckpointManager.save = save_then_die
elif mode == "mid-save":
    real_write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        result = real_write(self, plan, planner)
        result.wait()
        if dist.get_rank() == 1 and str(self.path).endswith(f"step-{step:08d}.tmp"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    FileSystemWriter.write_data = write_then_die
else:
    raise SystemExit(f"unknown mode {mode!r}")

sys.exit(train.run(sys.argv[3:]))
