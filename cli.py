"""The `meshtrain` command: one entry point, from any folder, for everything meshtrain does.

    meshtrain train --config debug_2d --nproc-per-node 4      # launches torchrun for you
    meshtrain train --config debug_2d --parallelism.tp 1 --parallelism.dp_shard 1   # one process
    meshtrain dry-run --config llama70b_2d --world-size 64    # trace one rank's step, no GPU
    meshtrain check --config llama405b_3d --world-size 512    # will it hang? (collectives match)
    meshtrain plan --model 70B --nodes 8 --seq-len 8192 --global-batch 512
    meshtrain estimate --config llama70b_2d --world-size 64
    meshtrain prepare-data corpus/ --out tokens/
    meshtrain export outputs/debug_2d/checkpoint/step-00000020 hf_out --format hf
    meshtrain evaluate outputs/debug_2d/checkpoint --config debug_2d --validation.split 0.05 --nproc-per-node 4
    meshtrain hang-report outputs/debug_2d                    # after a collective timed out: who is behind

`--config NAME` finds NAME.toml in ./configs or among the configs meshtrain ships. Each
subcommand's `--help` lists its own options. The `python -m meshtrain.planning.plan`-style
module paths still work; this is the same code under one name.
"""

from __future__ import annotations

import sys

# name -> (what it does, the function taking the rest of the command line). Imported on
# use: `meshtrain plan` should not pay for torch, nor `meshtrain --help` for anything.
COMMANDS = {
    "train": "train from a TOML config (--nproc-per-node N launches N processes with torchrun)",
    "dry-run": "trace one rank's step at any world size on fake tensors: memory, communication",
    "check": "dry-run every class of rank and check their collectives match (will it hang?)",
    "plan": "rank the layouts of a model on a cluster by estimated throughput",
    "estimate": "the planner's memory and step time for one config",
    "prepare-data": "tokenize a corpus once into memory-mapped shards (dataset = \"tokens\")",
    "export": "a DCP checkpoint to a Hugging Face folder, one torch file, or (a LoRA run) a PEFT adapter folder",
    "evaluate": "the validation loss of a saved checkpoint, under any layout (the test loop)",
    "hang-report": "after a collective timed out: which ranks were behind, and where (the run folder's hang/)",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: meshtrain COMMAND [options]   (meshtrain COMMAND --help for its options)", "",
             __doc__.split("\n\n")[0], "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def run_command(name: str, argv: list[str]) -> int:
    if name == "train":
        from meshtrain.training.launch import launch, split_for_torchrun

        if {"-h", "--help"} & set(argv):
            from meshtrain.training.config_loader import format_help

            print(format_help("meshtrain train", launcher="[--nproc-per-node N] [torchrun options] "))
            return 0
        launcher, rest = split_for_torchrun(argv)
        if launcher:
            return launch(launcher, rest)
        from meshtrain import train  # one process: this one

        return train.run(rest)
    if name in ("dry-run", "check"):
        from meshtrain import train

        # check: the collectives alone (dry-run --check-collectives adds the memory report first)
        flags = ["--check-collectives"] if name == "check" else ["--dry-run"]
        if {"-h", "--help"} & set(argv):
            print(f"usage: meshtrain {name} --config NAME --world-size N [--rank R] [--gpus-per-node G] "
                  f"[--gpu h100-80gb] [--jobs J] [--section.key VALUE ...]\n\n{COMMANDS[name]}.\n"
                  f"--jobs: processes tracing ranks at once (default: the cores this process may use).\n"
                  f"Every config key (see meshtrain train --help) can be overridden.")
            return 0
        return train.run([*argv, *flags])
    if name == "plan":
        from meshtrain.planning.plan import run

        return run(argv)
    if name == "estimate":
        from meshtrain.planning.estimate import main

        return main(argv)
    if name == "prepare-data":
        from meshtrain.training.prepare_data import main

        return main(argv)
    if name == "evaluate":
        return evaluate(argv)
    if name == "hang-report":
        from meshtrain.training.hang_report import main

        return main(argv)
    from meshtrain.training.export import main

    return main(argv)


def evaluate(argv: list[str]) -> int:
    """`meshtrain evaluate`: --help, N processes under torchrun (each running this command),
    or this process; bad input ends with one message and exit code 2, as for train."""
    from meshtrain import train
    from meshtrain.training import evaluate
    from meshtrain.training.launch import launch, split_for_torchrun

    if {"-h", "--help"} & set(argv):
        print(evaluate.USAGE)
        return 0
    launcher, rest = split_for_torchrun(argv)
    if launcher:
        return launch(launcher, ["evaluate", *rest], module="meshtrain.cli",
                      check=lambda args: evaluate.parse_command_line(args[1:]))
    return train.run(rest, command=evaluate.main)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"meshtrain: error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} "
              f"(meshtrain --help)", file=sys.stderr)
        return 2
    try:
        return run_command(argv[0], argv[1:])
    except SystemExit as done:  # argparse's --help and usage errors: their code, not an exit
        return done.code if isinstance(done.code, int) else int(done.code is not None)


if __name__ == "__main__":
    sys.exit(main())
