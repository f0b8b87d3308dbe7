"""One replica group of a [fault_tolerance] run, under its own torchrun, with a step that
takes a while and, optionally, a death:

    ft_replica.py RECORDS SECONDS KILL_STEP [train.py args]

Each step the group commits is appended to RECORDS (a JSON line from its rank 0: the step,
its loss, gradient norm and replica groups as logged, the time, torchrun's attempt). Every
step sleeps SECONDS first (a stand-in for a real step's compute, so the survivors are
still training while a killed group restarts). With KILL_STEP > 0, the group's rank 1
SIGKILLs itself before that step (or, if the group joined later, before its second step)
on torchrun's first attempt only: torchrun then restarts
the group, which rejoins the others. Everything else -- torchrun, the lighthouse, torchft,
gloo -- is real.
"""

import json
import os
import signal
import sys
import time

from meshtrain import train
import meshtrain.training.metrics as metrics
import meshtrain.training.recipe as recipe

records, seconds, kill_step, argv = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
first_attempt = attempt == 0
RESTART_DELAY = 8.0  # seconds
real_log = metrics.MetricsLogger.log


def log(self, step, scalars):
    real_log(self, step, scalars)
    if self.rank == 0 and "loss" in scalars:  # training steps only (validation logs too)
        with open(records, "a") as fh:
            fh.write(json.dumps({"step": step, "attempt": attempt, "time": time.time(),
                                 **{k: float(scalars[k]) for k in ("loss", "grad_norm", "replica_groups")}}) + "\n")


metrics.MetricsLogger.log = log
real_train_step = recipe.train_step  # what the step built by the recipe calls


trained = []  # the steps this attempt has trained


def train_step(*args, step, **kwargs):
    # Before step KILL_STEP, or, when the group joined late (it heals from the others' live
    # state, past KILL_STEP when its start-up was slow), before its second step: it always
    # dies on its first attempt with a step committed, whatever the machine's load.
    if first_attempt and kill_step and step >= kill_step and trained and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    trained.append(step)
    return real_train_step(*args, step=step, **kwargs)


recipe.train_step = train_step
if not first_attempt and kill_step:
    # A restart on a cluster takes tens of seconds (rescheduling, start-up); here torchrun
    # restarts the group in a few, sooner than the survivors notice it was gone. Wait, so
    # the survivors train alone meanwhile, as they would there.
    time.sleep(RESTART_DELAY)
sys.exit(train.run(argv))
