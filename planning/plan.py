"""Rank parallel layouts for a model on a cluster, on a laptop, in seconds.

    meshtrain plan --model llama3_70b --nodes 8 --gpus-per-node 8 --gpu h100-80gb \\
           --seq-len 8192 --global-batch 512 [--top 10] [--write best.toml]

Enumerates every layout train.py accepts (tp inside a node x pp x dp_replicate x dp_shard,
context parallelism inside the node too for sequences of LONG_SEQ tokens or more,
micro-batch size, pipeline schedule and micro-batches, activation checkpointing, FSDP
strategy: planning/search.py), drops those that do not fit in memory, and ranks the rest
by estimated tokens/s per GPU (planning/estimate.py, docs/planning.md): estimates to
choose between layouts, not measurements. `meshtrain dry-run` measures the memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from meshtrain.models import registry
from meshtrain.physics.gpus import GIB, GPUS, HEADROOM, get_gpu, usable_bytes
from meshtrain.planning import hardware, kernels, matmul
from meshtrain.planning.report import describe, format_breakdown, format_table, to_toml
from meshtrain.planning.search import LONG_SEQ, plan
from meshtrain.planning.shape import REDUCE_BYTES, Job, ModelShape
from meshtrain.planning.step_time import ASYNC_TP_HIDES
from meshtrain.planning.verify import verify

MODEL_ALIASES = {"llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B", "llama3_1b": "1B"}
LLAMA3_VOCAB = 128_256  # the Llama 3 tokenizer; "debug" keeps its own tiny vocabulary


class PlanError(ValueError):
    """Bad input for the planner; the message is the whole explanation."""


SHAPE_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")  # [model]'s keys


def resolve_model(name: str, **dims: int) -> ModelShape:
    """A Llama flavor ("70B", "llama3_70b") or any family's as "family:flavor" ("gpt2:175B"),
    with ``dims`` (SHAPE_FLAGS, as [model] takes them) over the flavor's: a custom size."""
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
    vocab = dims.pop("vocab_size", None) or (LLAMA3_VOCAB if family == "llama" and found != "debug" else None)
    flags = lambda: ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in dims.items())
    known = dataclasses.fields(flavors[found])
    for key in dims:
        if key not in {f.name for f in known}:
            raise PlanError(f"--{key.replace('_', '-')}: the {family} family has no such setting; its dimensions: "
                            + ", ".join(f"--{k.replace('_', '-')}" for k in SHAPE_FLAGS
                                        if k in {f.name for f in known} or k == "vocab_size"))
    try:
        return ModelShape.from_flavor(found, vocab, family, **dims)
    except ValueError as err:  # the family's own check (dim % n_heads, ...)
        raise PlanError(f"{flags()}: {err}") from None


# ---------------------------------------------------------------- command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors in the project's format, exit 2
        raise PlanError(message)


def parse_args(argv):
    p = _Parser(prog="meshtrain plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Llama flavor (8B, 70B, 405B, debug, llama3_70b...), "
                   "or family:flavor for another family (gpt2:175B)")
    for key in SHAPE_FLAGS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, metavar="N",
                       help=f"the model's {key} instead of the flavor's ([model] {key})")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--efficiency", type=float,
                   help="fraction of the bf16 peak compute reaches (default: the GPU's measured "
                        "large-matmul fraction, an upper bound for a whole step)")
    p.add_argument("--attention-efficiency", type=float, metavar="X",
                   help="fraction of the bf16 peak the attention kernel reaches, forward and backward, for "
                        "another kernel than torch's SDPA (default: SDPA's speed by sequence length as measured "
                        "on H100 and H200, physics/kernels/; elsewhere FlashAttention-2's published fraction)")
    p.add_argument("--tp-overlap", type=float, default=0.0, metavar="X",
                   help="TP's sequence-parallel gathers and scatters pipelined with their matmuls: the share of "
                        f"what could hide that does (torch's async TP, [compile] async_tp: {ASYNC_TP_HIDES}, as "
                        "torchtitan measured it; Transformer Engine's overlap, as Megatron and NeMo run it: 1.0). "
                        "Default 0: exposed, as train.py runs TP without async TP")
    hardware.add_arguments(p)
    p.add_argument("--moe-imbalance", type=float, default=Job.moe_imbalance, metavar="X",
                   help="a mixture of experts under ep: the busiest ep rank receives X times the mean token "
                        f"copies (default {Job.moe_imbalance}: docs/planning.md, Mixture of experts)")
    p.add_argument("--chunked-loss", action="store_true",
                   help="plan for [training] chunked_loss = true: the loss keeps the bf16 logits and no fp32 "
                        "copy of them (4 bytes per logit at its peak instead of 12)")
    p.add_argument("--compile", action="store_true",
                   help="plan for [compile] enable = true and loss = true: each block compiled (its element-wise "
                        "chains fused; it keeps what inductor's partitioner saves) and the loss compiled (the bf16 "
                        "logits kept, 8 bytes a logit moved); --write writes both keys")
    p.add_argument("--reduce-dtype", choices=sorted(REDUCE_BYTES), default="float32",
                   help="plan for [training] mixed_precision_reduce: FSDP reduces gradients in this dtype "
                        "(bfloat16: half the reduction's bytes; default float32); --write writes it")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--write", metavar="PATH.toml", help="write the best layout as a train.py config")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="dry-run the top K layouts at full world size (meshtrain dry-run, fake tensors: "
                        "tens of seconds each for 70B, --jobs at once) and re-rank them by traced memory")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="processes tracing probes, judging layouts and dry-running --verify's at once "
                        "(default: the cores this process may use)")
    return p.parse_args(argv)


def matmul_speeds(gpu) -> str:
    """How the estimate times matmuls on ``gpu``: its measured table, or the roofline."""
    if matmul.measured_tables(matmul.TABLES).get(gpu.name):
        return f"matmuls at the speeds measured by shape (physics/kernels/, {gpu.name})"
    return f"large matmuls at {gpu.matmul_efficiency:.0%} of it (others by shape over {gpu.sms} SMs)"


def attention_speed(gpu, seq: int, given: float = 0.0) -> str:
    """How the estimate times attention on ``gpu`` at ``seq``: as ``given``, measured by length,
    or published."""
    if given:
        return f"attention at {given:.0%} (--attention-efficiency)"
    rate = kernels.attention_rate(seq, gpu) / gpu.peak_bf16_flops
    if kernels.measured_attention(matmul.TABLES).get(gpu.name):
        return f"attention at {rate:.0%} (measured by length, physics/kernels/)"
    return f"flash attention at {rate:.0%}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.verify < 0:
        raise PlanError("--verify must be at least 0")
    for flag in ("nodes", "gpus_per_node", "seq_len", "global_batch", "top", "jobs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
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
    if args.attention_efficiency is not None and not 0 < args.attention_efficiency <= 1:
        raise PlanError(f"--attention-efficiency {args.attention_efficiency} must be in (0, 1]")
    if not 0 <= args.tp_overlap <= 1:
        raise PlanError(f"--tp-overlap {args.tp_overlap} must be in [0, 1]: the share of TP's gathers and "
                        f"scatters that hides ({ASYNC_TP_HIDES} torch's async TP, 1.0 all it can)")
    try:
        net = hardware.from_arguments(args, gpu, args.gpus_per_node)
    except hardware.TopologyError as err:
        raise PlanError(str(err)) from None
    dims = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    for key, value in dims.items():
        if value < 1:
            raise PlanError(f"--{key.replace('_', '-')} must be at least 1")
    if not 1 <= args.moe_imbalance < float("inf"):
        raise PlanError(f"--moe-imbalance {args.moe_imbalance}: the busiest rank receives at least the mean; "
                        "use a number >= 1")
    if args.compile and args.chunked_loss:
        raise PlanError("--compile with --chunked-loss: train.py refuses [compile] loss = true with [training] "
                        "chunked_loss = true (both keep only the bf16 logits); use one of them")
    job = Job(resolve_model(args.model, **dims), gpu, args.nodes, args.gpus_per_node, args.seq_len, args.global_batch,
              topology=net, moe_imbalance=args.moe_imbalance, chunked_loss=args.chunked_loss,
              compiled=args.compile, compiled_loss=args.compile,
              attention_efficiency=args.attention_efficiency or 0.0, tp_overlap=args.tp_overlap,
              reduce_dtype=args.reduce_dtype)
    if job.model.max_positions and args.seq_len > job.model.max_positions:
        raise PlanError(f"--seq-len {args.seq_len} is longer than {args.model}'s {job.model.max_positions} "
                        f"learned positions, which train.py refuses; use --seq-len <= {job.model.max_positions}")

    fitting, smallest, rejected = plan(job, jobs=args.jobs)
    n = job.model.n_params
    size = (f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M") + " params"
    if job.model.moe_layers:
        a = job.model.active_params
        size += (f", {a / 1e9:.1f}B active: {job.model.n_experts} experts, top {job.model.top_k}; the busiest ep "
                 f"rank assumed to receive {job.moe_imbalance} x the mean")
    resized = (" with " + ", ".join(f"{k} {v}" for k, v in (*job.model.dims, ("n_layers", job.model.n_layers)))
               if dims else "")
    print(f"{job.model.family} {job.model.flavor}{resized} ({size}) on {job.nodes} x "
          f"{job.gpus_per_node} {gpu.name}, seq {job.seq_len}, global batch {job.global_batch} "
          f"sequences{', chunked loss' if job.chunked_loss else ''}{', compiled blocks and loss' if job.compiled else ''}"
          f"{', bf16 gradient reductions' if job.reduce_dtype == 'bfloat16' else ''}"
          f"{f', TP inside the matmuls ({job.tp_overlap:.0%} of what can hide, --tp-overlap)' if job.tp_overlap else ''}; peak {gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s "
          f"bf16: {matmul_speeds(gpu)}, {attention_speed(gpu, job.seq_len, job.attention_efficiency)}, "
          f"memory-bound work at {gpu.hbm_bandwidth / 1e12:.1f} TB/s; {net.describe()}. Estimates, not measurements "
          f"(docs/planning.md, Validation).")
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
        fitting = verify(fitting[:args.verify], job, jobs=args.jobs) + fitting[args.verify:]
    if args.write:
        from pathlib import Path

        path = Path(args.write)
        command = "meshtrain plan " + " ".join(a for a in argv if not a.startswith("--write")
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
