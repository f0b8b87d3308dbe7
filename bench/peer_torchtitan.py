"""Training throughput side by side with torchtitan, the peer meshtrain is measured against.

    python -m bench.peer_torchtitan --device cuda --layers 4 --seq-len 8192 --compile --ac op [--float8]
    python -m bench.peer_torchtitan --device cpu --layers 1 --seq-len 64 --steps 2 --warmup 1   # seconds

Needs a released torchtitan (0.2.x, the line that runs on torch 2.10 / 2.11) and the packages
its import pulls in (tyro, datasets, torchdata; docs/benchmarks.md lists them); it is not a
dependency of meshtrain.

The options are bench/throughput.py's, and both variants train the same Llama shape on the
same random tokens, timed by the same loop (throughput.measure), each run in a fresh process
(`--side` runs one), in the order torchtitan, meshtrain, meshtrain, torchtitan:

- torchtitan: its own pieces, as its Trainer assembles them -- the llama3 train spec's
  `Transformer` (its model args with our shape: dim, heads, kv heads, FFN width, vocab,
  layers, sequence), its model converters (float8 tensorwise through its Float8LinearConverter,
  the output head left out as in meshtrain), its `parallelize_llama` (selective op / full /
  every-k activation checkpointing, per-block torch.compile, FSDP2 with bf16 parameters and
  fp32 reduction), its AdamW and LR scheduler builders, its summed cross-entropy divided by
  the token count, and its gradient clipping. On one rank torchtitan skips FSDP and uses
  autocast instead; here its own `apply_fsdp` shards anyway, so that both variants keep fp32
  master weights and run the same mixed-precision machinery, as they do on many GPUs.
- meshtrain: throughput.build_meshtrain with the same options.

The weights start from each framework's own init, so the loss columns differ; tokens/s,
peak memory and their ratio are what this compares. `compare` is what bench/gpu_check.py
calls; `main` prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench import throughput
from meshtrain.parallel import shutdown_distributed
from meshtrain.training.metrics import device_peak_flops, model_flops_per_token

ROOT = Path(__file__).resolve().parent.parent

# meshtrain's activation checkpointing modes in torchtitan's terms: (mode, selective_ac_option)
AC_MODES = {"none": ("none", None), "op": ("selective", "op"), "full": ("full", None)}


def torchtitan_version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


def job_config(args, world: int):
    """torchtitan's JobConfig with bench/throughput.py's options."""
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.model.name, jc.model.flavor = "llama3", args.flavor
    jc.training.seq_len = args.seq_len
    jc.training.local_batch_size = args.batch
    jc.training.dtype = "float32"  # master weights; FSDP casts them for compute
    jc.training.mixed_precision_param = args.dtype
    jc.training.mixed_precision_reduce = "float32"
    jc.training.max_norm = 1.0
    jc.parallelism.data_parallel_shard_degree = world
    jc.compile.enable = args.compile or args.compile_loss
    jc.compile.components = ["model"] * args.compile + ["loss"] * args.compile_loss
    mode = AC_MODES.get(args.ac, ("selective", str(args.ac_every)))  # "selective": one block in ac_every
    jc.activation_checkpoint.mode = mode[0]
    if mode[1]:
        jc.activation_checkpoint.selective_ac_option = mode[1]
    if args.float8:
        jc.model.converters = ["quantize.linear.float8"]
        jc.quantize.linear.float8.filter_fqns = ["output"]
        # torchtitan refuses float8 without an SM 8.9 GPU unless told to emulate (eager only);
        # meshtrain runs torch's reference float8 matmul on CPU instead.
        jc.quantize.linear.float8.emulate = args.device == "cpu"
    jc.optimizer.name, jc.optimizer.lr, jc.optimizer.eps = "AdamW", 3e-4, 1e-8
    jc.optimizer.beta1, jc.optimizer.beta2, jc.optimizer.weight_decay = 0.9, 0.95, 0.1
    jc.optimizer.implementation = "fused"
    return jc


def model_args(args, jc):
    """torchtitan's TransformerModelArgs with the shape of meshtrain's flavor. torchtitan derives
    the FFN width from dim, multiple_of and ffn_dim_multiplier; the published flavors name it so,
    others get a multiplier and a rounding that land on meshtrain's width (checked in build)."""
    import dataclasses

    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    cfg = throughput.new_model(args).cfg
    if args.flavor in llama3_args:
        targs = dataclasses.replace(llama3_args[args.flavor], n_layers=cfg.n_layers, vocab_size=cfg.vocab_size)
    else:
        base = int(2 * 4 * cfg.dim / 3)
        targs = TransformerModelArgs(
            dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            vocab_size=cfg.vocab_size, multiple_of=cfg.ffn_hidden, ffn_dim_multiplier=cfg.ffn_hidden / base,
            norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)
    targs.update_from_config(jc)
    return targs, cfg


def build_torchtitan(args, mesh, device):
    """torchtitan's model, parallelization, optimizer and training step, assembled as its
    Trainer does (torchtitan/train.py), minus data loading, logging and checkpointing."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils as tt_utils

    world = dist.get_world_size()
    if world > 1 and device.type == "cpu":
        raise ValueError("torchtitan builds its device mesh on CUDA whenever no accelerator is found: on CPU "
                         "run bench.peer_torchtitan as one process (no torchrun)")
    if args.accum != 1:
        raise ValueError("--accum: the torchtitan side runs one micro-batch a step")
    jc = job_config(args, world)
    spec = get_train_spec("llama3")
    parallel_dims = ParallelDims(dp_shard=world, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                 world_size=world)
    targs, cfg = model_args(args, jc)
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[jc.training.dtype]):
        model = spec.model_cls(targs)
    ffn = model.layers["0"].feed_forward.w1.weight.shape[0]
    ours = sum(p.numel() for p in throughput.new_model(args).parameters())
    theirs = sum(p.numel() for p in model.parameters())
    if ffn != cfg.ffn_hidden or theirs != ours:
        raise RuntimeError(f"torchtitan's model is not meshtrain's shape: FFN width {ffn} vs {cfg.ffn_hidden}, "
                           f"{theirs:,} vs {ours:,} parameters")
    converters = build_model_converters(jc, parallel_dims)
    converters.convert(model)
    if args.float8:  # torchtitan's converter only warns when torchao cannot do it
        from torchao.float8.float8_linear import Float8Linear

        if not any(isinstance(m, Float8Linear) for m in model.modules()):
            raise RuntimeError("torchtitan's float8 converter converted no Linear layer (see its warning above)")
    model = spec.parallelize_fn(model, parallel_dims, jc)
    if not parallel_dims.fsdp_enabled:  # one rank: shard anyway (see the module's docstring)
        apply_fsdp(model, mesh, param_dtype=TORCH_DTYPE_MAP[jc.training.mixed_precision_param],
                   reduce_dtype=TORCH_DTYPE_MAP[jc.training.mixed_precision_reduce], pp_enabled=False)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = spec.build_optimizers_fn([model], jc.optimizer, parallel_dims)
    schedulers = spec.build_lr_schedulers_fn(optimizers, jc.lr_scheduler, jc.training.steps)
    optimizers.register_step_post_hook(lambda *a, **k: converters.post_optimizer_hook([model]))
    loss_fn = spec.build_loss_fn(jc, parallel_dims=parallel_dims)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None

    def step(inputs, labels):  # Trainer.train_step and forward_backward_step, one microbatch
        optimizers.zero_grad()
        tokens = (labels != IGNORE_INDEX).sum().to(device)
        total = dist_utils.dist_sum(tokens, batch_mesh) if batch_mesh is not None else tokens.float()
        inputs, labels = inputs.to(device), labels.to(device)
        # No autocast: torchtitan uses it only without FSDP, and FSDP casts the parameters here.
        pred = model(inputs)
        loss = loss_fn(pred, labels) / total
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), jc.training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        return loss.item()  # meshtrain's train_step syncs on its loss too

    return model, optimizers, step


ORDER = ("torchtitan", "meshtrain", "meshtrain", "torchtitan")


def measure_side(side: str, args) -> dict:
    """One side's row (throughput.measure), in this process's world."""
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = torch.distributed.device_mesh.init_device_mesh(args.device, (dist.get_world_size(),),
                                                          mesh_dim_names=("dp_shard",))
    flops = model_flops_per_token(throughput.new_model(args), args.seq_len)  # train.py's MFU definition
    if side == "torchtitan":
        name, build = f"torchtitan {torchtitan_version()}", build_torchtitan
    else:  # needs no torchtitan: bench/float8_speedup.py runs meshtrain's rows this way too
        name, build = throughput.describe(args), throughput.build_meshtrain
    return throughput.measure(name, build, args, mesh, device, flops, device_peak_flops(device), args.compile)


def run_side(side: str, argv: list[str], nproc: int = 1, timeout: float = 900) -> dict:
    """One side's row (`measure_side`), measured in a fresh process (under torchrun when
    ``nproc`` > 1). ``argv``: bench/throughput.py's options."""
    module = ["-m", "bench.peer_torchtitan", *argv, "--side", side]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                             if nproc > 1 else []), *module]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line[len(ROW):]) for line in proc.stdout.splitlines() if line.startswith(ROW)]
    if proc.returncode or not rows:
        raise RuntimeError(f"the {side} run ({' '.join(argv)}) exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return rows[0]


def compare(argv: list[str], nproc: int = 1, timeout: float = 900) -> dict:
    """Four runs in the order torchtitan, meshtrain, meshtrain, torchtitan (ABBA, against
    drift in clocks and temperature), each in a fresh process: on an H100, meshtrain measured
    after torchtitan in the same process ran 9% slower in float8 than alone (26.1k vs 28.7k
    tokens/s; no torch config differed between them), so a shared process measures the
    order, not the code. ``argv``: bench/throughput.py's options. Returns each side's rows,
    its tokens/s averaged, and meshtrain's over torchtitan's."""
    runs = {"torchtitan": [], "meshtrain": []}
    for side in ORDER:
        runs[side].append(run_side(side, argv, nproc, timeout))
    result = {"order": ", ".join(ORDER) + " (each a fresh process)"}
    for side, rows in runs.items():
        result[side] = {**rows[0], "runs": rows}
        if all("error" not in r for r in rows):
            n = len(rows)
            for key in ("tokens_per_second", "tflops", "mfu", "step_seconds"):
                if rows[0].get(key) is not None:
                    result[side][key] = sum(r[key] for r in rows) / n
            result[side]["peak_memory_gib"] = max(r.get("peak_memory_gib") or 0 for r in rows)
    both = all("error" not in r for rows in runs.values() for r in rows)
    result["ratio"] = (result["meshtrain"]["tokens_per_second"] / result["torchtitan"]["tokens_per_second"]
                       if both else None)
    return result


ROW = "PEER_ROW "


def main(argv=None) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as both trainers do
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--side", choices=("torchtitan", "meshtrain"), default=None,
                   help="run only this side, in this process, and print its row (what compare launches)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun); CUDA only for torchtitan")
    own, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = throughput.parse_args(rest)
    if own.side:
        store_file = throughput.init_world(args.device)
        if args.device == "cpu":
            torch.set_flush_denormal(True)  # see throughput.main
        row = measure_side(own.side, args)
        if dist.get_rank() == 0:
            print(ROW + json.dumps(row), flush=True)
        shutdown_distributed()
        if store_file and os.path.exists(store_file):
            os.remove(store_file)
        return row
    result = compare(rest, own.nproc)
    shape = throughput.new_model(args)
    num_params = sum(p.numel() for p in shape.parameters())
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result.update(device=name, world_size=own.nproc, torch=torch.__version__, torchtitan_version=torchtitan_version(),
                  flops_per_token=model_flops_per_token(shape, args.seq_len), steps=args.steps, warmup=args.warmup,
                  dtype=args.dtype, shape={"flavor": args.flavor, "n_layers": shape.cfg.n_layers, "dim": shape.cfg.dim,
                                           "params": num_params, "seq_len": args.seq_len,
                                           "batch_per_device": args.batch})
    print(f"peer_torchtitan: Llama {args.flavor}, {shape.cfg.n_layers} layers, {num_params / 1e6:,.1f}M params | "
          f"seq {args.seq_len} x batch {args.batch} per device | {args.dtype}, ac={args.ac}"
          f"{', compile' if args.compile else ''}{', float8' if args.float8 else ''} | {args.steps} steps after "
          f"{args.warmup} warm-up | {name} x {own.nproc} | torch {torch.__version__}, torchtitan "
          f"{result['torchtitan_version']} | {result['order']}")
    for side in ("torchtitan", "meshtrain"):
        each = ", ".join(f"{r['tokens_per_second']:,.0f}" if "error" not in r else r["error"] for r in result[side]["runs"])
        print(f"  {side} runs, tokens/s: {each}")
    print(throughput.table([result["torchtitan"], result["meshtrain"]], torch.device(args.device),
                           ratio_label="meshtrain / torchtitan"), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
