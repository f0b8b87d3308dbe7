"""Rank parallel layouts for a model on a cluster, on a laptop, in seconds.

    python -m planning.plan --model llama3_70b --nodes 8 --gpus-per-node 8 --gpu h100-80gb \\
           --seq-len 8192 --global-batch 512 [--top 10] [--write best.toml]

Enumerates every layout train.py accepts (tp inside a node x pp x dp_replicate x dp_shard,
context parallelism inside the node too for sequences of LONG_SEQ tokens or more,
micro-batch size, pipeline schedule and micro-batches, activation checkpointing, FSDP
strategy), drops those that do not fit in memory, and ranks the rest by estimated
tokens/s per GPU. The formulas are in planning/cost.py and docs/planning.md: estimates to
choose between layouts, not measurements. `train.py --dry-run` measures the memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import Counter

from meshtrain.parallel.context_parallel import check_cp_fits
from meshtrain.parallel.fsdp import check_strategy
from meshtrain.parallel.mesh import LayoutError, ParallelDims, check_tp_fits
from meshtrain.planning.cost import Estimate, Job, Layout, ModelShape, estimate, memory_per_gpu
from meshtrain.planning.hardware import GIB, GPUS, HEADROOM, get_gpu, usable_bytes

# Fraction of HBM left free for what the formulas do not count: the caching allocator's
# fragmentation, the CUDA context, NCCL and cuBLAS workspaces.
AC_MODES = ("none", "selective", "full", "op")
# (schedule, stages per rank). GPipe is left out: same bubble as 1F1B, more memory.
PP_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))
# Context parallelism is tried from this sequence length on: below it a sequence's
# activations fit beside the model states on one GPU, and cp only adds all-to-alls.
LONG_SEQ = 32_768
MODEL_ALIASES = {"llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B", "llama3_1b": "1B"}
LLAMA3_VOCAB = 128_256  # the Llama 3 tokenizer; "debug" keeps its own tiny vocabulary


class PlanError(ValueError):
    """Bad input for the planner; the message is the whole explanation."""


def resolve_model(name: str) -> ModelShape:
    """A Llama flavor ("70B", "llama3_70b") or any family's as "family:flavor" ("gpt2:175B")."""
    from meshtrain.models import registry

    family, _, flavor = name.rpartition(":")
    family = family or "llama"
    if family not in registry.FAMILIES:
        raise PlanError(f"unknown model family {family!r}; accepted: {', '.join(registry.FAMILIES)}")
    flavors = registry.get(family).flavors
    by_lower = {k.lower(): k for k in flavors}
    found = (MODEL_ALIASES.get(flavor.lower()) if family == "llama" else None) or by_lower.get(flavor.lower())
    if found is None:
        accepted = ", ".join([*flavors, *(MODEL_ALIASES if family == "llama" else ())])
        raise PlanError(f"unknown {family} model {flavor!r}; accepted: {accepted} (other families: "
                        f"{', '.join(f + ':FLAVOR' for f in registry.FAMILIES if f != family)})")
    vocab = LLAMA3_VOCAB if family == "llama" and found != "debug" else None
    return ModelShape.from_flavor(found, vocab, family)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(job: Job, lay: Layout) -> None:
    """The rules train.py applies before starting, from the same functions; LayoutError if
    broken. (The pipeline rules run inside cost.rank_shares, via check_pipeline.)"""
    ParallelDims(dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp, pp=lay.pp, cp=lay.cp,
                 world_size=job.world)
    check_tp_fits(lay.tp, job.model.tp_divisible, seq_len=job.seq_len, gpus_per_node=job.gpus_per_node)
    problems = check_cp_fits(lay.cp, lay.tp, heads=job.model.n_heads, seq_len=job.seq_len, sequence_parallel=True)
    if problems:
        raise LayoutError("cp does not fit the model: " + "; ".join(problems))
    if job.global_batch % lay.dp:
        raise LayoutError(f"global batch {job.global_batch} is not divisible by dp = {lay.dp}")
    check_strategy(lay.strategy, {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
                                  "cp": lay.cp, "tp": lay.tp})
    if lay.fsdp_shard == 1:
        raise LayoutError("no data-parallel sharding: model states would be held whole on every GPU")


def candidates(job: Job):
    """Every layout to try (unchecked): tp (x cp, for long sequences) divides a node, pp and
    dp the rest."""
    for tp, cp in ((tp, cp) for tp in divisors(job.gpus_per_node)
                   for cp in (divisors(job.gpus_per_node // tp) if job.seq_len >= LONG_SEQ else (1,))):
        for pp in divisors(job.world // (tp * cp)):
            dp = job.world // (tp * cp * pp)
            for dp_replicate in divisors(dp):
                if dp == dp_replicate and cp == 1:  # no shard group: FSDP would not be applied (NO_SHARD)
                    continue
                strategies = (("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") if dp_replicate > 1
                              else ("FULL_SHARD", "SHARD_GRAD_OP"))
                local = job.global_batch // dp if job.global_batch % dp == 0 else 1
                schedules = PP_SCHEDULES if pp > 1 else (("1F1B", 1),)
                for micro_batch in divisors(local):
                    for schedule, v in schedules:
                        for strategy in strategies:
                            for ac in AC_MODES:
                                yield Layout(tp=tp, pp=pp, dp_replicate=dp_replicate,
                                             dp_shard=dp // dp_replicate, strategy=strategy, ac=ac,
                                             micro_batch=micro_batch, pp_schedule=schedule,
                                             pp_microbatches=local // micro_batch if pp > 1 else 1,
                                             stages_per_rank=v, cp=cp)


def plan(job: Job) -> tuple[list[Estimate], Estimate | None, Counter]:
    """(the layouts that fit, fastest first; when none fits, the one needing the least
    memory; how many candidates each rule rejected)."""
    budget = usable_bytes(job.gpu)
    fitting, smallest, rejected = [], None, Counter()
    for lay in candidates(job):
        try:
            check_layout(job, lay)
            total = memory_per_gpu(job, lay).total
        except LayoutError as err:
            rejected[str(err).split(":")[0]] += 1
            continue
        if total <= budget:
            fitting.append(estimate(job, lay))
        elif smallest is None or total < smallest[0]:
            smallest = (total, lay)
    # Ties (common: hidden FSDP traffic costs nothing here) go to less memory, then fewer bytes.
    fitting.sort(key=lambda e: (-e.tokens_per_s_per_gpu, e.memory.total, sum(e.comm_bytes.values())))
    return fitting, (estimate(job, smallest[1]) if not fitting and smallest else None), rejected


# ---------------------------------------------------------------- output

def describe(lay: Layout) -> str:
    pipe = f"pp {lay.pp} {lay.pp_schedule} x {lay.pp_microbatches} micro-batches, " if lay.pp > 1 else ""
    cp = f"cp {lay.cp}, " if lay.cp > 1 else ""
    return (f"tp {lay.tp}, {cp}{pipe}dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}, "
            f"{lay.strategy}, AC {lay.ac}, micro-batch {lay.micro_batch}")


def format_table(estimates: list[Estimate]) -> str:
    cp = any(e.layout.cp > 1 for e in estimates)  # a cp column only where cp was tried
    head = ("#", "tp", *(("cp",) if cp else ()), "pp", "dp_rep", "dp_shard", "strategy", "AC", "mbs", "schedule",
            "pp_mb", "GiB/GPU", "step s", "tok/s/GPU", "MFU")
    rows = [head]
    for i, e in enumerate(estimates, 1):
        lay = e.layout
        rows.append((str(i), str(lay.tp), *((str(lay.cp),) if cp else ()), str(lay.pp), str(lay.dp_replicate),
                     str(lay.dp_shard), lay.strategy, lay.ac, str(lay.micro_batch),
                     lay.pp_schedule if lay.pp > 1 else "-", str(lay.pp_microbatches) if lay.pp > 1 else "-",
                     f"{e.memory.total / GIB:.1f}", f"{e.step_time:.2f}",
                     f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    left = {head.index(name) for name in ("strategy", "AC", "schedule")}  # text columns
    return "\n".join("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in
                               enumerate(zip(r, widths))).rstrip() for r in rows)


def format_breakdown(e: Estimate, gpu, title: str = "Best") -> str:
    """One layout's estimate: memory by category, traffic, step time by part."""
    m = e.memory
    where = f" (pipeline rank {m.pp_rank}, the fullest)" if e.layout.pp > 1 else ""
    lines = [f"{title}: {describe(e.layout)}", f"  memory per GPU{where}, GiB:"]
    for name in ("params", "grads", "optimizer", "activations", "transient"):
        lines.append(f"    {name:<12}{getattr(m, name) / GIB:8.2f}")
    verdict = "fits in" if m.total <= usable_bytes(gpu) else "does NOT fit in"
    lines.append(f"    {'total':<12}{m.total / GIB:8.2f}   {verdict} {usable_bytes(gpu) / GIB:.0f} usable of "
                 f"{gpu.hbm_bytes / GIB:.0f} ({HEADROOM:.0%} headroom)")
    lines.append("  sent per GPU per step, GB:  " + "  ".join(
        f"{dim} {b / 1e9:.1f}" for dim, b in e.comm_bytes.items()))
    lines.append("  step time, s:  " + "  ".join(f"{k} {v:.2f}" for k, v in e.times.items())
                 + f"  = {e.step_time:.2f}")
    lines.append("  compute, s:  " + "  ".join(f"{k} {v:.2f}" for k, v in e.compute_split.items())
                 + "  (matmuls, flash attention, memory-bound element-wise work: planning/kernels.py)")
    lines.append(f"  FSDP collectives take {e.fsdp_comm_time:.2f} s, {e.fsdp_comm_time / e.times['compute']:.0%} "
                 f"of the compute they are assumed to hide behind")
    return "\n".join(lines)


def to_toml(e: Estimate, job: Job, name: str, command: str) -> str:
    """The layout as a config for train.py (same shape as configs/llama70b_2d.toml)."""
    lay, m = e.layout, job.model
    local = lay.local_batch(job) if lay.pp > 1 else lay.micro_batch
    pipe = [f'pp_schedule = "{lay.pp_schedule}"', f"pp_microbatches = {lay.pp_microbatches if lay.pp > 1 else 0}"]
    if lay.pp > 1 and lay.stages_per_rank > 1:
        pipe.append(f"pp_stages_per_rank = {lay.stages_per_rank}")
    if lay.pp == 1:
        pipe = [p + "    # unused without a pipeline" for p in pipe]
    return "\n".join([
        f"# Planned by: {command}",
        f"# Estimate (formulas, not a measurement; see docs/planning.md): "
        f"{e.memory.total / GIB:.1f} GiB per GPU of {job.gpu.hbm_bytes / GIB:.0f},",
        f"# {e.step_time:.2f} s per step, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {e.mfu:.1%} "
        f"on {job.nodes} x {job.gpus_per_node} {job.gpu.name}.",
        f"# Measure the memory: python train.py --config {name}.toml --dry-run --world-size {job.world}",
        f"# Launch on each of {job.nodes} node(s):",
        f"#   torchrun --nnodes={job.nodes} --nproc-per-node={job.gpus_per_node} --rdzv-backend=c10d \\",
        f"#            --rdzv-endpoint=HOST:29500 train.py --config {name}.toml",
        "",
        "[job]", f'name = "{name}"', 'output_dir = "outputs"',
        f'description = "{m.family} {m.flavor}: {describe(lay)}"', 'device = "cuda"', "",
        "[model]", f'name = "{m.family}"', f'flavor = "{m.flavor}"', f"vocab_size = {m.vocab}", "",
        "[training]", f"global_batch_size = {job.global_batch}",
        f"local_batch_size = {local}" + ("" if lay.pp > 1 else
                                          f"      # {lay.micro_batches(job)} accumulation step(s)"),
        f"seq_len = {job.seq_len}", 'mixed_precision_param = "bfloat16"',
        'mixed_precision_reduce = "float32"', "",
        "[parallelism]", f"dp_replicate = {lay.dp_replicate}", f"dp_shard = {lay.dp_shard}",
        f"tp = {lay.tp}", f"pp = {lay.pp}", *([f"cp = {lay.cp}"] if lay.cp > 1 else []), *pipe,
        f'sharding_strategy = "{lay.strategy}"',
        "sequence_parallel = true", "loss_parallel = true", "",
        "[activation_checkpoint]", f'mode = "{lay.ac}"', "selective_every = 2", ""])


def trace(e: Estimate, job: Job) -> dict:
    """The dry run's report of a layout: its config as --write would write it, traced at
    the job's world size on the first rank of the pipeline rank the estimate says is fullest."""
    import tempfile
    from pathlib import Path

    from meshtrain.planning.dry_run import dry_run
    from meshtrain.training.config_loader import load_config

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "traced.toml"
        path.write_text(to_toml(e, job, path.stem, "python -m planning.plan --verify"))
        rank = e.memory.pp_rank * (job.world // e.layout.pp)  # pp is the outermost mesh dimension
        return dry_run(load_config(path), job.world, rank, gpus_per_node=job.gpus_per_node, quiet=True)


def verify(estimates: list[Estimate], job: Job) -> list[Estimate]:
    """Trace each layout and print traced beside estimated peaks; a layout whose trace does
    not fit drops to the end, and one where the two differ by more than 10% is flagged.
    Returns the layouts re-ranked: those the trace says fit, fastest first, then the others."""
    print(f"\nVerifying the top {len(estimates)} with a dry run each ({job.world} ranks, fake tensors):")
    traced = []
    for i, e in enumerate(estimates, 1):
        report = trace(e, job)
        peak = report["memory"]["total"]
        traced.append((e, peak))
        off = peak / e.memory.total - 1
        flag = "  <-- differ by more than 10%" if abs(off) > 0.10 else ""
        fits = "fits" if peak <= usable_bytes(job.gpu) else "does NOT fit"
        print(f"  {i}. {describe(e.layout)}: estimated {e.memory.total / GIB:.1f} GiB, traced "
              f"{peak / GIB:.1f} GiB ({off:+.0%}, {report['seconds']:.0f} s), {fits}{flag}")
    ok = [e for e, peak in traced if peak <= usable_bytes(job.gpu)]
    return ok + [e for e, peak in traced if peak > usable_bytes(job.gpu)]


# ---------------------------------------------------------------- command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors in the project's format, exit 2
        raise PlanError(message)


def parse_args(argv):
    p = _Parser(prog="meshtrain plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Llama flavor (8B, 70B, 405B, debug, llama3_70b...), "
                   "or family:flavor for another family (gpt2:175B)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--efficiency", type=float,
                   help="fraction of the bf16 peak compute reaches (default: the GPU's measured "
                        "large-matmul fraction, an upper bound for a whole step)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--write", metavar="PATH.toml", help="write the best layout as a train.py config")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="dry-run the top K layouts at full world size (train.py --dry-run, fake tensors: "
                        "tens of seconds each for 70B) and re-rank them by traced memory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.verify < 0:
        raise PlanError("--verify must be at least 0")
    for flag in ("nodes", "gpus_per_node", "seq_len", "global_batch", "top"):
        if getattr(args, flag) < 1:
            raise PlanError(f"--{flag.replace('_', '-')} must be at least 1")
    world = args.nodes * args.gpus_per_node
    if world < 2:
        raise PlanError("one GPU has nothing to plan: FSDP needs at least 2 (use --nodes/--gpus-per-node)")
    if math.gcd(args.global_batch, world) < 2 and args.seq_len < LONG_SEQ:  # (cp can split one sequence)
        raise PlanError(f"--global-batch {args.global_batch} is not divisible by any data-parallel "
                        f"degree of {world} GPUs (it shares no factor with {world})")
    try:
        gpu = get_gpu(args.gpu)
    except KeyError as err:
        raise PlanError(err.args[0]) from None
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise PlanError(f"--efficiency {args.efficiency} must be in (0, 1]")
        gpu = dataclasses.replace(gpu, matmul_efficiency=args.efficiency)
    job = Job(resolve_model(args.model), gpu, args.nodes, args.gpus_per_node, args.seq_len, args.global_batch)
    if job.model.max_positions and args.seq_len > job.model.max_positions:
        raise PlanError(f"--seq-len {args.seq_len} is longer than {args.model}'s {job.model.max_positions} "
                        f"learned positions, which train.py refuses; use --seq-len <= {job.model.max_positions}")

    fitting, smallest, rejected = plan(job)
    n = job.model.n_params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    print(f"{job.model.family} {job.model.flavor} ({size} params) on {job.nodes} x "
          f"{job.gpus_per_node} {gpu.name}, seq {job.seq_len}, global batch {job.global_batch} "
          f"sequences; peak {gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16: matmuls at {gpu.matmul_efficiency:.0%} "
          f"of it, flash attention at {gpu.attention_efficiency:.0%}, memory-bound work at "
          f"{gpu.hbm_bandwidth / 1e12:.1f} TB/s. Estimates, not measurements (docs/planning.md, Validation).")
    if not fitting and smallest is None:
        reasons = "; ".join(f"{why} ({n} layouts)" for why, n in rejected.most_common(3))
        raise PlanError(f"no valid layout for {job.world} GPUs: {reasons}")
    if not fitting:
        print(f"No layout fits: the best layout needs {smallest.memory.total / GIB:.1f} GiB of "
              f"{gpu.hbm_bytes / GIB:.0f} GiB per GPU ({usable_bytes(gpu) / GIB:.1f} usable "
              f"with {HEADROOM:.0%} headroom): {describe(smallest.layout)}.")
        print(format_breakdown(smallest, gpu, "Smallest"))
        return 1
    print(f"{len(fitting)} layouts fit in {usable_bytes(gpu) / GIB:.0f} GiB "
          f"({HEADROOM:.0%} headroom); the top {min(args.top, len(fitting))} by tokens/s/GPU:\n")
    print(format_table(fitting[:args.top]))
    print()
    print(format_breakdown(fitting[0], gpu))
    if args.verify:
        fitting = verify(fitting[:args.verify], job) + fitting[args.verify:]
    if args.write:
        from pathlib import Path

        path = Path(args.write)
        command = "python -m planning.plan " + " ".join(a for a in argv if not a.startswith("--write")
                                                        and a != args.write)
        path.write_text(to_toml(fitting[0], job, path.stem, command))
        print(f"\nwrote {path}")
    return 0


def run(argv: list[str] | None = None) -> int:
    try:
        return main(argv)
    except PlanError as err:
        print(f"meshtrain: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
