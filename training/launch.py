"""`meshtrain train`: the trainer in this process, or N of them under torchrun's own launcher.

    meshtrain train --config debug_2d --nproc-per-node 4 --training.steps 2

Every torchrun option (`--nproc-per-node`, `--nnodes`, `--node-rank`, `--rdzv-endpoint`,
`--max-restarts`, ...) is passed to `torch.distributed.run`, which starts the processes;
everything else goes to the trainer (`python -m meshtrain.train`). Two things differ from
typing `torchrun -m meshtrain.train` yourself:

- the config is read and checked here first, so a typo costs no process start;
- an error raised once ranks run (a refused layout, a failed collective) is said once --
  the first rank's message -- instead of once per rank inside torchrun's report of every
  failed child. The ranks leave their message in the error file torchrun gives each of
  them (train.py `tell_torchrun`) and print nothing; this process prints the first.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

TRAINER = "meshtrain.train"
ONE_MESSAGE = "MESHTRAIN_LAUNCHER"  # set for the ranks: leave the error to the launcher
# torchrun options that would replace what this launcher runs, or are ours.
NOT_PASSED = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path", "-h", "--help"}


def torchrun_options() -> dict[str, bool]:
    """Every option string torchrun's own parser accepts -> whether it takes a value."""
    from torch.distributed.run import get_args_parser

    options = {}
    for action in get_args_parser()._actions:
        for flag in action.option_strings:
            if flag not in NOT_PASSED:
                options[flag] = action.nargs != 0
    return options


def split_for_torchrun(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, the trainer's) from one command line."""
    options = torchrun_options() if any(a.startswith("-") for a in argv) else {}
    launcher, trainer, i = [], [], 0
    while i < len(argv):
        flag = argv[i].partition("=")[0]
        if flag in options:
            takes_value = options[flag] and "=" not in argv[i]
            launcher += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            trainer.append(argv[i])
            i += 1
    return launcher, trainer


def launch(launcher: list[str], argv: list[str], module: str = TRAINER, check=None) -> int:
    """Run the trainer (or another ``module``: `meshtrain evaluate`) under torchrun with
    ``launcher``'s options; the exit code of the first failed rank, its one message
    printed. ``check(argv)``: the module's own reading of its command line (default: the
    trainer's), made here first."""
    from meshtrain.training.config import ConfigError
    from meshtrain.training.config_loader import parse_args

    try:
        (check or parse_args)(argv)  # the same check every rank makes, made once, before any process starts
    except ConfigError as err:
        print(f"meshtrain: error: {err}", file=sys.stderr, flush=True)
        return 2

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "LOGLEVEL" not in os.environ:  # torchrun's own account of each failed child: we say it once
        for name in ("torch.distributed.elastic", "torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[ONE_MESSAGE] = "1"
    args = torchrun.parse_args([*launcher, "-m", module, *argv])
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as err:
        print(first_error(err), file=sys.stderr, flush=True)
        return failed_exit_code(err)
    except SignalException as stop:  # SIGTERM/SIGINT here: torchrun passed it on to every rank
        print(f"meshtrain: stopped by {stop.sigval.name}", file=sys.stderr, flush=True)
        return 128 + stop.sigval


def first_failure(err):
    """The failed rank to report: the earliest (torchrun's error files keep seconds, so
    among equals a rank with a message of ours, then the lowest)."""
    ranked = sorted(err.failures.items(),
                    key=lambda kv: (kv[1].timestamp, not kv[1].message.startswith("meshtrain:"), kv[0]))
    return ranked[0]


def failed_exit_code(err) -> int:
    """The exit code for the message `first_error` says. Every rank may find the same bad
    input and leave the same message; the first to exit makes torchrun SIGTERM the rest,
    and one of those may be the rank reported (same second, lower rank) with -15 for a
    code. The code is then that of a rank with the same message that did exit."""
    _, failure = first_failure(err)
    same = [f.exitcode for f in err.failures.values() if f.message == failure.message and f.exitcode > 0]
    return failure.exitcode if failure.exitcode > 0 else (same[0] if same else 1)


def first_error(err) -> str:
    rank, failure = first_failure(err)
    if failure.message.startswith("meshtrain:"):
        return failure.message
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"meshtrain: error: rank {rank} was killed by {name}"
    return f"meshtrain: error: rank {rank} exited with code {failure.exitcode} (its traceback is above)"
