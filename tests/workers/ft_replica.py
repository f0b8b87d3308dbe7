"""One replica group of a [fault_tolerance] run, under its own torchrun, with a step that
takes a while and, optionally, a death:

    ft_replica.py RECORDS SECONDS KILL_STEP [train.py args]

Each step the group commits is appended to RECORDS (a JSON line from its rank 0: the step,
its loss, gradient norm and replica groups as logged, the time, torchrun's attempt). Every
step sleeps SECONDS first (a stand-in for a real step's compute, so the survivors are
still training while a killed group restarts). The groups' first attempts ask
for their first quorum together (a file per group beside RECORDS), as groups launched as one
job would: on a loaded machine one torchrun can come up many seconds after the other. With
KILL_STEP > 0, the group's rank 1 SIGKILLs itself before that step (or, if the group
joined later, before its second step), once a step of this attempt was committed with both
groups, on torchrun's first attempt only: torchrun then restarts the group, which rejoins
the others from their live state. Everything else -- torchrun, the lighthouse, torchft,
gloo -- is real.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from meshtrain import train
import meshtrain.training.fault_tolerance as fault_tolerance
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
GROUPS = 2  # the replica groups tests/test_fault_tolerance.py launches, each writing its RECORDS beside ours


def start_together(timeout: float = 300.0) -> None:
    """Mark this group ready and wait until every group is."""
    Path(records + ".ready").touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(records).parent.glob("*.ready"))) < GROUPS:
        if time.monotonic() > deadline:
            sys.exit(f"the other replica group did not come up within {timeout:.0f} s")
        time.sleep(0.05)


def trained_with_every_group() -> bool:
    """Whether this attempt committed a step with every group in the quorum (rank 0's
    records; a line being written may be cut short). Killed before that, the group would
    take its state with it: the others would start afresh, a second history of the same steps."""
    try:
        lines = Path(records).read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r["attempt"] == attempt and r["replica_groups"] == GROUPS:
            return True
    return False


def train_step(*args, step, **kwargs):
    # Before step KILL_STEP, or, when the group joined late (it heals from the others' live
    # state, past KILL_STEP when its start-up was slow), before its second step: it always
    # dies on its first attempt with a step committed, whatever the machine's load.
    if first_attempt and kill_step and step >= kill_step and trained and os.environ.get("RANK") == "1" \
            and trained_with_every_group():
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    trained.append(step)
    return real_train_step(*args, step=step, **kwargs)


recipe.train_step = train_step
real_steps = fault_tolerance.FaultTolerance.steps


def steps(self, first, last):
    if first_attempt:  # before the first quorum, which a group alone would form by itself
        start_together()
    yield from real_steps(self, first, last)


fault_tolerance.FaultTolerance.steps = steps
if not first_attempt and kill_step:
    # A restart on a cluster takes tens of seconds (rescheduling, start-up); here torchrun
    # restarts the group in a few, sooner than the survivors notice it was gone. Wait, so
    # the survivors train alone meanwhile, as they would there.
    time.sleep(RESTART_DELAY)
sys.exit(train.run(argv))
