"""Run train.py with a fault injected at a chosen step, the way it happens on a cluster:

    faults.py kill "R:K:S,..." [train.py args]  on restart R (TORCHELASTIC_RESTART_COUNT),
                                               rank K SIGKILLs itself before step S
    faults.py sigterm K S [train.py args]       rank K gets SIGTERM before step S (only it)
    faults.py stall K S SECONDS [train.py args] rank K sleeps SECONDS before step S
    faults.py nan S [train.py args]             the loss of step S is NaN on every rank
    faults.py disk_full K S [train.py args]     rank K's checkpoint writes fail with ENOSPC from step S
    faults.py sigterm_startup K POINT [args]    rank K gets SIGTERM at POINT of start-up (tests/workers/startup_points.py)

Everything else — the launcher (torchrun, or tests/forked_ranks.py), the process groups,
checkpoints, the restart — is real.
"""

import os
import signal
import sys
import time


from meshtrain import train
import meshtrain.training.recipe as recipe
import meshtrain.training.step as step_module

mode, argv = sys.argv[1], sys.argv[2:]
rank = int(os.environ.get("RANK", 0))
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

if mode == "kill":
    plan = [tuple(int(x) for x in item.split(":")) for item in argv[0].split(",")]
    targets = {step for r, k, step in plan if r == restart and k == rank}
    argv = argv[1:]

    def before(step):
        if step in targets:
            os.kill(os.getpid(), signal.SIGKILL)
elif mode == "sigterm":
    who, when, argv = int(argv[0]), int(argv[1]), argv[2:]

    def before(step):
        if rank == who and step == when:
            os.kill(os.getpid(), signal.SIGTERM)
elif mode == "stall":
    who, when, seconds, argv = int(argv[0]), int(argv[1]), float(argv[2]), argv[3:]

    def before(step):
        if rank == who and step == when:
            time.sleep(seconds)
elif mode == "nan":
    when, argv = int(argv[0]), argv[1:]
    poisoned = [False]

    def poison(real_loss):
        return lambda logits, labels: real_loss(logits, labels) * (float("nan") if poisoned[0] else 1.0)

    # The step sums token losses (and divides by the global count); the mean is what a
    # pipeline's loss function uses before a step has set its scale.
    step_module.summed_cross_entropy = poison(step_module.summed_cross_entropy)
    step_module.cross_entropy = poison(step_module.cross_entropy)

    def before(step):
        poisoned[0] = step == when
elif mode == "disk_full":  # rank `who`'s writes fail with ENOSPC from step `when` on
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    who, when, argv = int(argv[0]), int(argv[1]), argv[2:]
    real_write, current = dcp_fs._write_item, [0]

    def write_item(*args, **kwargs):
        if rank == who and current[0] >= when:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "__%d_0.distcp" % rank)
        return real_write(*args, **kwargs)
    dcp_fs._write_item = write_item

    def before(step):
        current[0] = step
elif mode == "sigterm_startup":
    who, point, argv = int(argv[0]), argv[1], argv[2:]
    if rank == who:
        from tests.workers.startup_points import signal_at
        signal_at(point)

    def before(step):
        pass
else:
    raise SystemExit(f"unknown mode {mode!r}")

real_train_step = recipe.train_step  # what the step built by the recipe calls


def train_step(*args, step, **kwargs):
    before(step)
    return real_train_step(*args, step=step, **kwargs)


recipe.train_step = train_step
sys.exit(train.run(argv))
