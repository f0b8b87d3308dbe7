"""Training throughput and MFU: meshtrain's path next to a hand-written plain-PyTorch one.

    python bench/throughput.py --device cpu                               # small shape, seconds
    python bench/throughput.py --flavor 8B --layers 8 --seq-len 8192 --batch 1 \\
        --steps 20 --warmup 5 --compile --ac op                           # one GPU
    torchrun --nproc-per-node 8 bench/throughput.py --flavor 8B --seq-len 8192 --batch 1 \\
        --compile --ac op                                                 # FSDP over 8 GPUs

Both variants train the same Llama shape on the same random tokens in the same process,
one after the other, each for ``--warmup`` steps and then ``--steps`` timed ones:

- baseline: what one writes by hand with torch alone, with the same options: torchao's
  float8 swap, torch's checkpoint_wrapper (with a selective policy for "op"),
  torch.compile per block, `fully_shard` on each block and the root with a
  MixedPrecisionPolicy, `torch.optim.AdamW(fused=True)` and clip_grad_norm_ -- no
  meshtrain code besides the model itself (its class and its init, so that both variants
  start from the same weights).
- meshtrain: `parallel.parallelize` with the chosen mixed precision, compile, activation
  checkpointing (and float8) options, and `training.step.train_step`.

Printed per variant: tokens/s per device, model TFLOP/s per device (6·N + attention, see
docs/benchmarks.md), MFU against the detected GPU's dense bf16 peak (n/a on CPU or an
unknown GPU), and peak memory -- the CUDA allocator's peak, or on CPU the process's
peak RSS plus the bytes of activations one forward keeps (TrackedActivations). ``--json``
writes the same numbers. A world of one process needs no launcher: the script starts a
one-rank process group itself, so FSDP2 (and its mixed precision) runs as it would on
many GPUs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshtrain.models.llama import Llama
from meshtrain.parallel import AC_MODES, mixed_precision_policy, parallelize, shutdown_distributed, submesh
from meshtrain.parallel.float8 import apply_float8
from meshtrain.physics.gpus import GIB
from meshtrain.training.config import DTYPES
from meshtrain.training.metrics import (TrackedActivations, device_peak_flops, memory_stats, model_flops_per_token,
                              reset_peak_rss)
from meshtrain.training.optim import build_optimizer
from meshtrain.training.step import select_loss, train_step



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--flavor", default=None, help="Llama shape (debug, 1B, 8B, 70B, 405B); "
                   "default: debug on CPU, 8B on GPU")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the flavor's)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 256 on CPU, 8192 on GPU")
    p.add_argument("--batch", type=int, default=None, help="sequences per device per step "
                   "(default: 4 on CPU, 1 on GPU)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation): the "
                   "per-parameter work (optimizer, clipping, gradient reduction) is spread over --accum times "
                   "the tokens, as it is over the ranks of a many-GPU job, where each steps its shard")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter/compute dtype; gradients are reduced and master weights kept in "
                   "fp32 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--compile", action="store_true", help="meshtrain: torch.compile each block")
    p.add_argument("--compile-loss", action="store_true", help="meshtrain: torch.compile the loss")
    p.add_argument("--ac", choices=AC_MODES, default="none", help="meshtrain: activation checkpointing")
    p.add_argument("--ac-every", type=int, default=2, help="--ac selective: one block in this many")
    p.add_argument("--float8", action="store_true", help="float8 Linear layers (torchao), in both variants")
    p.add_argument("--float8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
                   help="torchao's scaling recipe for --float8")
    p.add_argument("--baseline-ac", choices=AC_MODES, default=None,
                   help="baseline: activation checkpointing (default: the same as --ac)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if gpu else "cpu"
    args.flavor = args.flavor or ("8B" if gpu else "debug")
    args.seq_len = args.seq_len or (8192 if gpu else 256)
    args.batch = args.batch or (1 if gpu else 4)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    return args


# ---------------------------------------------------------------- the two variants

def build_meshtrain(args, mesh, device) -> tuple[nn.Module, object, Callable]:
    model = new_model(args)
    if args.float8:
        # The head stays in high precision, as train.py does.
        apply_float8(model, skip=("output",), recipe=args.float8_recipe)
    select_loss(compiled=args.compile_loss)
    # With a mixed-precision policy parallelize applies FSDP even on one rank, like the
    # baseline's fully_shard, so both variants run the same sharding machinery.
    model = parallelize(model, mesh, sharding_strategy="FULL_SHARD",
                        mixed_precision=mixed_precision_policy(args.dtype, "float32"),
                        activation_checkpoint=args.ac, ac_every=args.ac_every, compile=args.compile)
    model.init_weights(seed=0, device=device)
    optimizer = build_optimizer(model, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    dp_mesh = submesh(mesh, "dp")

    def step(inputs, labels):
        loss, _ = train_step(model, optimizer, [(inputs, labels)] * args.accum, max_norm=1.0, dp_mesh=dp_mesh,
                             device=device)
        return loss

    return model, optimizer, step


def build_baseline(args, mesh, device) -> tuple[nn.Module, object, Callable]:
    """What one writes by hand with torch alone, with the same options as meshtrain's row:
    torchao's float8 swap, torch's checkpoint_wrapper (with a selective policy for "op"),
    torch.compile per block, FSDP2 per block with fp32 master weights, fused AdamW."""
    model = new_model(args)
    if args.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "output",
                                   config=Float8LinearConfig.from_recipe_name(args.float8_recipe))
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype), reduce_dtype=torch.float32)
    ac = args.baseline_ac or args.ac
    for i, (key, block) in enumerate(list(model.layers.items())):
        if ac == "op":
            block = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, _save_matmuls_and_attention))
        elif ac == "full" or (ac == "selective" and i % args.ac_every == 0):
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if args.compile:
            block = torch.compile(block, fullgraph=True)
        model.layers[key] = block
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # The model's own init, so both variants train the same numbers: their loss columns
    # agree (to rounding) when the options change no math.
    model.init_weights(seed=0, device=device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), fused=True)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    if args.compile_loss:
        loss_fn = torch.compile(loss_fn)

    def step(inputs, labels):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(args.accum):  # the mean over micro-batches, as train_step reports
            loss = loss_fn(model(inputs.to(device)), labels.to(device)) / args.accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return total.item()  # train_step syncs on its loss too

    return model, optimizer, step


_BASELINE_SAVED = [getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, name)]


def _save_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _BASELINE_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def new_model(args) -> Llama:
    overrides = {"max_seq_len": args.seq_len}
    if args.layers:
        overrides["n_layers"] = args.layers
    return Llama.from_flavor(args.flavor, meta=True, **overrides)


# ---------------------------------------------------------------- measuring

def measure(name: str, build, args, mesh, device, flops: float, peak: float | None, compiled: bool,
            profile_to: Path | None = None) -> dict:
    """Build one variant, warm it up, time ``args.steps`` steps; free it again.
    ``profile_to``: then profile two more steps and write the top ops there (appended)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, new_model(args).cfg.vocab_size, (args.batch, args.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    row = {"name": name}
    try:
        model, optimizer, step = build(args, mesh, device)
        start = time.perf_counter()
        for _ in range(args.warmup):
            step(inputs, labels)
        _sync(device)
        row["warmup_seconds"] = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the timed steps' peak: a steady-state step
        else:
            reset_peak_rss()
        start = time.perf_counter()
        ends = []  # each step ends in a host sync (loss.item()), so these are step boundaries
        for _ in range(args.steps):
            loss = step(inputs, labels)
            ends.append(time.perf_counter())
        _sync(device)
        elapsed = time.perf_counter() - start
        row["step_times"] = [b - a for a, b in zip([start] + ends[:-1], ends)]
        if profile_to is not None:
            profile_steps(name, step, inputs, labels, device, profile_to)
    except torch.OutOfMemoryError:  # the other variant may still fit: report this one as such
        row["error"] = "out of memory"
        model = optimizer = step = None
        _free(device)
        return row
    tps = args.accum * args.batch * args.seq_len * args.steps / elapsed  # per device: each rank runs its own batch
    row.update(tokens_per_second=tps, tflops=tps * flops / 1e12, mfu=tps * flops / peak if peak else None,
               final_loss=loss, step_seconds=elapsed / args.steps)
    if device.type == "cuda":
        row.update(peak_memory_gib=torch.cuda.max_memory_allocated(device) / GIB, memory_kind="cuda max allocated",
                   peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB)
    else:
        row.update(peak_memory_gib=memory_stats(device)["peak_rss_gib"], memory_kind="peak RSS (process)",
                   activation_mib=None)
        if not compiled:  # compiled code allocates out of the tracker's sight (and refuses its mode)
            with TrackedActivations() as kept:
                logits = model(inputs)  # what autograd keeps for backward stays alive with it
            row["activation_mib"] = kept.bytes() / 2**20
            del logits
    del model, optimizer, step
    _free(device)
    return row


def profile_steps(name, step, inputs, labels, device, path: Path) -> None:
    """Two steps under torch.profiler; the ops that took the most device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(inputs, labels)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"== {name}: two steps ==\n{prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)}\n")


def _free(device):
    gc.collect()
    torch._dynamo.reset()  # compiled graphs of this variant: the next one must not hit the recompile limit
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- main

def init_world(device_type: str) -> str | None:
    """torchrun's environment if launched by it, else a world of one through a file store
    (no port to pick). Returns the store's file, to delete at the end."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return None
    fd, path = tempfile.mkstemp(prefix="bench_store_")
    os.close(fd)
    dist.init_process_group(backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
    return path


def describe(args) -> str:
    ours = [args.dtype, f"ac={args.ac}" + (f"/{args.ac_every}" if args.ac == "selective" else "")]
    ours += [opt for opt, on in (("compile", args.compile), ("compile-loss", args.compile_loss),
                                 ("float8", args.float8)) if on]
    return "meshtrain " + "+".join(ours)


def table(rows: list[dict], device: torch.device, ratio_label: str = "ours / baseline") -> str:
    cpu = device.type == "cpu"
    head = ["", "tokens/s", "TFLOP/s", "MFU", "peak mem GiB"] + (["activations MiB"] if cpu else []) + \
        ["step s", "warm-up s", "loss"]
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append([r["name"], r["error"]] + [""] * (len(head) - 2))
            continue
        lines.append([r["name"], f"{r['tokens_per_second']:,.0f}", f"{r['tflops']:.3f}",
                      "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", f"{r['peak_memory_gib']:.2f}"]
                     + ([_mib(r["activation_mib"])] if cpu else [])
                     + [f"{r['step_seconds']:.4f}", f"{r['warmup_seconds']:.1f}", f"{r['final_loss']:.4f}"])
    if all("error" not in r for r in rows):
        base, ours = rows
        ratio = [f"{ours['tokens_per_second'] / base['tokens_per_second']:.2f}x", "", "",
                 f"{ours['peak_memory_gib'] / base['peak_memory_gib']:.2f}x"]
        if cpu:
            ratio.append("" if ours["activation_mib"] is None else
                         f"{ours['activation_mib'] / base['activation_mib']:.2f}x")
        lines.append([ratio_label, *ratio] + [""] * (len(head) - 1 - len(ratio)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def _mib(value: float | None) -> str:
    return "n/a (compiled)" if value is None else f"{value:.2f}"


def main(argv=None) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train.py does
    args = parse_args(argv)
    store_file = init_world(args.device)
    if args.device == "cpu":
        # After a few steps AdamW's second moments of small gradients become subnormal
        # floats, which x86 CPUs process tens of times slower (GPUs do not): timings
        # would measure that, not the training step.
        torch.set_flush_denormal(True)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp_shard",))
    shape = new_model(args)
    num_params = sum(p.numel() for p in shape.parameters())
    flops = model_flops_per_token(shape, args.seq_len)  # train.py's MFU definition (physics/flops.py)
    peak = device_peak_flops(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [measure("plain PyTorch (fully_shard)", build_baseline, args, mesh, device, flops, peak, False),
            measure(describe(args), build_meshtrain, args, mesh, device, flops, peak, args.compile)]
    result = {
        "device": name, "world_size": world, "torch": torch.__version__,
        "peak_bf16_flops": peak, "flops_per_token": flops,
        "shape": {"flavor": args.flavor, "n_layers": shape.cfg.n_layers, "dim": shape.cfg.dim,
                  "params": num_params, "seq_len": args.seq_len, "batch_per_device": args.batch},
        "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype, "rows": rows,
    }
    if dist.get_rank() == 0:
        print(f"bench: Llama {args.flavor}, {shape.cfg.n_layers} layers, dim {shape.cfg.dim}, "
              f"{num_params / 1e6:,.1f}M params | seq {args.seq_len} x batch {args.batch} per device | "
              f"{args.steps} steps after {args.warmup} warm-up | {name} x {world} | torch {torch.__version__}")
        print(f"model FLOPs per token {flops:.4g}; peak {'n/a (no bf16 peak known for ' + name + ')' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16 dense'}")
        print(table(rows, device), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    shutdown_distributed()
    if store_file and os.path.exists(store_file):
        os.remove(store_file)
    return result


if __name__ == "__main__":
    main()
