"""One command that proves the CUDA path and measures it, on one GPU, in under 9 minutes.

    python -m bench.gpu_check --out results/             # one GPU: everything below
    python -m bench.gpu_check --out /tmp/c --device cpu  # tiny shapes on CPU (the test suite runs this)

1. environment: torch, CUDA, the GPU, and a measured 8192^3 bf16 matmul next to the
   spec peak -- the roofline any MFU is bounded by in practice.
2. checks: `train.py` under torchrun on one GPU (NCCL, world size 1) trains the debug
   config and learns; a checkpoint copied out at step 10 resumes and continues bitwise;
   bf16 parameters give losses within 1e-2 of fp32 (and not equal to them).
3. throughput: Llama-3-8B-shaped blocks (as many as the dry run says fit), seq 8192, bf16
   compute with fp32 master weights and reduction, AdamW: activation checkpointing
   none / op / full x compile off / on, and float8 when torchao imports. Each row runs
   meshtrain's path and, in the same process, a hand-written plain-torch loop with the
   same options (bench/throughput.py's baseline), and reports the ratio.
4. memory: the dry run's predicted peak for each eager row's exact config, next to
   torch.cuda.max_memory_allocated / max_memory_reserved.
5. document masking: tokens/s of a packed, document-masked step next to the causal step
   (bench/document_masking.py: 8 Llama-3-8B-shaped blocks, bf16, seq 2048 and 8192; one
   short sequence on CPU). Target: masked >= 0.95x causal. On CUDA also the boolean SDPA
   mask beside FlexAttention, the two kernels' agreement, and train.py with masking under
   op-level activation checkpointing and under torch.compile.
6. mixture of experts: bench/moe_grouped_mm.py's expert kernels (loop / grouped / padded,
   up to a Qwen3-30B-A3B layer, bf16) and a train.py step of 3 Qwen3-30B-A3B-shaped MoE
   blocks (seq 4096, 4 micro-batches of 2 a step, bf16): tokens/s and MFU on active
   parameters. CPU: the smallest kernel
   shape only.
   Beside it the same step with every block dense (`--moe.n_dense_layers=3`: an FFN as wide
   as the 8 active experts together, the same attention): the dense baseline of the same
   active size.
7. operations (CUDA only): a [profiling] window writes its trace and the allocator's
   history pickle; a run made to run out of GPU memory writes rank0_oom.pickle and names it.
8. float8 (CUDA only): bench/float8_curves.py, train.py for 200 steps in bf16 (two seeds),
   float8 tensorwise and rowwise; the throughput rows above hold float8's tokens/s; then
   bench/float8_speedup.py, float8 over bf16 with 8 micro-batches a step, fresh processes.
9. optimizer (CUDA only): bench/muon_step.py, one rank's Muon step against fused AdamW at
   Llama-3-8B's hidden matrices for a shard group of 8.
10. peer (CUDA, when a released torchtitan imports): bench/peer_torchtitan.py, torchtitan's
   model and parallelize_llama against meshtrain on the throughput rows' shape (compiled,
   op-level checkpointing), bf16 and float8 tensorwise, tokens/s side by side, each run in
   a fresh process (torchtitan, meshtrain, meshtrain, torchtitan).
11. kernels (CUDA only, run right after the environment): bench/kernel_speeds.py, matmul
   TFLOP/s per block shape, attention and copy speeds: the planner's per-shape tables
   (also DIR/kernel_speeds.json).

Writes DIR/gpu_check.json, DIR/gpu_check.md and DIR/profile.txt (the top kernels of one
compiled step). A row that would overrun ``--budget`` seconds is reported as skipped,
never half-measured; ``--rows`` picks rows by name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch
from torch.distributed.device_mesh import init_device_mesh

from bench import throughput
from meshtrain.parallel.mesh import shutdown_distributed
from meshtrain.physics.gpus import GIB
from meshtrain.training.metrics import device_peak_flops, model_flops_per_token

# name -> (activation checkpointing, compile, float8 recipe or None)
ROWS = {
    "eager ac=none": ("none", False, None),
    "compile ac=none": ("none", True, None),
    "compile ac=op": ("op", True, None),
    "compile ac=full": ("full", True, None),
    "eager ac=op": ("op", False, None),
    "eager ac=full": ("full", False, None),
    "float8 compile ac=op": ("op", True, "tensorwise"),
    "float8 rowwise compile ac=op": ("op", True, "rowwise"),
}
PROFILED_ROW = "compile ac=op"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json / .md / profile.txt")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--layers", type=int, default=0, help="8B-shaped blocks (default: as many as the dry run "
                   "predicts fit in --fill of the GPU with ac none; 2 on CPU)")
    p.add_argument("--fill", type=float, default=0.85, help="fraction of GPU memory the chosen layers may fill")
    p.add_argument("--steps", type=int, default=0, help="timed steps per variant (default 8; 2 on CPU)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first, compilation among them "
                   "(default 2; 1 on CPU)")
    p.add_argument("--rows", default="", help="comma-separated row names or 'eager' / 'compile' "
                   f"(default: all; eager rows on CPU). Rows: {'; '.join(ROWS)}")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: checks, throughput, memory, "
                   "document_masking, moe, operations, float8, optimizer, peer, kernels")
    p.add_argument("--budget", type=float, default=530.0, help="seconds for the whole command: rows that "
                   "would not finish in time are skipped")
    args = p.parse_args(argv)
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if gpu else "cpu"
    args.steps = args.steps or (8 if gpu else 2)
    args.warmup = args.warmup or (2 if gpu else 1)
    args.skip = {s for s in args.skip.split(",") if s}
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()] or (["all"] if gpu else ["eager"])
    args.rows = [name for name, (_, compiled, _) in ROWS.items()
                 if "all" in wanted or name in wanted or ("compile" if compiled else "eager") in wanted]
    unknown = [w for w in wanted if w not in ROWS and w not in ("all", "eager", "compile")]
    if unknown:
        p.error(f"--rows: unknown {unknown}; accepted: all, eager, compile, {', '.join(ROWS)}")
    return args


# ---------------------------------------------------------------- 1. environment

def matmul_tflops(device: torch.device) -> float:
    """Median of 20 timed n^3 matmuls on random data (never zeros: they run faster)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(23):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t
        if i >= 3:  # warm-up: cuBLAS handles, clocks
            times.append(seconds)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = device_peak_flops(device)
    smi = None
    if device.type == "cuda" and shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    expandable = None
    if device.type == "cuda":
        torch.empty(1, device=device)  # the allocator exists from here on: did it read the setting?
        expandable = any(seg.get("is_expandable") for seg in torch.cuda.memory_snapshot())
    return {"nvidia_smi": smi, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "expandable_segments": expandable, "device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(),
            "memory_gib": torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None,
            "spec_tflops": spec / 1e12 if spec else None, "matmul_tflops": matmul_tflops(device)}


# ---------------------------------------------------------------- 2. the CUDA path through train.py

def subprocess_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "2"}


def train_cmd(device_type: str, out: Path, name: str, *extra: str) -> list[str]:
    # The CPU smoke run (the test suite's) trains the same 20 steps on half the sequence:
    # the same checks in half the time; the CUDA run keeps the config's length.
    shorter = ["--training.seq_len=64"] if device_type == "cpu" else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "train.py"), "--config", "debug_2d", f"--job.device={device_type}",
            "--parallelism.dp_shard=1", "--parallelism.tp=1", "--training.steps=20", "--metrics.log_freq=1",
            *shorter, f"--job.output_dir={out}", f"--job.name={name}", *extra]


def logged(out: Path, name: str, tag: str = "loss") -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / name / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def cuda_path_checks(device_type: str, out: Path) -> dict:
    """Three train.py runs (fp32 with checkpoints at 10 and 20, bf16 beside it, then a run
    resumed from a copy of the step-10 checkpoint), judged from their TensorBoard files."""
    env = subprocess_env()
    run = lambda cmd: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    ckpt = ("--checkpoint.enable=true", "--checkpoint.interval=10")
    procs = {"fp32": run(train_cmd(device_type, out, "fp32", *ckpt)),
             "bf16": run(train_cmd(device_type, out, "bf16", "--training.mixed_precision_param=bfloat16"))}
    result, logs = {}, {}
    for name, proc in procs.items():
        logs[name] = proc.communicate(timeout=300)[0]
        if proc.returncode:
            raise RuntimeError(f"train.py ({name}) exited {proc.returncode}:\n{logs[name][-3000:]}")
    step10 = out / "fp32" / "checkpoint" / "step-00000010"
    shutil.copytree(step10, out / "resumed" / "checkpoint" / step10.name)
    proc = run(train_cmd(device_type, out, "resumed", *ckpt, "--checkpoint.if_config_differs=resume"))
    logs["resumed"] = proc.communicate(timeout=300)[0]
    if proc.returncode or "resumed at step 10" not in logs["resumed"]:
        raise RuntimeError(f"train.py (resumed) did not resume at step 10:\n{logs['resumed'][-3000:]}")
    fp32, bf16, resumed = (logged(out, n) for n in ("fp32", "bf16", "resumed"))
    result["losses_fp32"], result["losses_bf16"], result["losses_resumed"] = fp32, bf16, resumed
    result["learns"] = len(fp32) == 20 and sum(fp32[-3:]) / 3 < 0.8 * fp32[0]
    norms, norms_resumed = logged(out, "fp32", "grad_norm"), logged(out, "resumed", "grad_norm")
    result["resume_bitwise"] = resumed == fp32[10:] and norms_resumed == norms[10:]
    rel = [abs(b - f) / abs(f) for b, f in zip(bf16, fp32)]
    result["bf16_max_rel_diff"] = max(rel)
    # Within 1e-2, yet not equal: equal losses would mean bf16 never reached the compute.
    result["bf16_close"] = len(bf16) == 20 and max(rel) <= 1e-2 and max(rel) > 1e-6
    result["device_line"] = next((line for line in logs["fp32"].splitlines() if "DeviceMesh" in line), "")
    return result


# ---------------------------------------------------------------- 4. the dry run's prediction

def dry_run_argv(layers: int, ac: str, device_type: str) -> list[str]:
    """The measured config as train.py flags (the dry run traces eager code: compile off)."""
    if device_type == "cuda":
        base = ["--config", "llama3_8b", "--training.seq_len=8192", "--training.mixed_precision_param=bfloat16"]
    else:
        base = ["--config", "debug_2d", f"--training.seq_len={CPU_SEQ}", "--training.mixed_precision_param=float32",
                "--model.vocab_size=256"]
    return base + [f"--model.n_layers={layers}", "--training.global_batch_size=1", "--training.local_batch_size=1",
                   "--parallelism.dp_shard=1", "--parallelism.tp=1", "--training.mixed_precision_reduce=float32",
                   "--parallelism.sharding_strategy=FULL_SHARD", f"--activation_checkpoint.mode={ac}",
                   "--compile.enable=false", "--float8.enable=false"]


def predict_peaks_gib(configs: list[tuple[int, str]], device_type: str) -> list[float]:
    """The dry run's peak for one rank of each (layers, ac), in one subprocess (it needs a
    fake process group; one Python start-up for them all)."""
    code = ("import json, sys; from training.config_loader import parse_args; from planning.dry_run import dry_run\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    cfg, _ = parse_args(argv); r = dry_run(cfg, 1)\n"
            "    print('PEAK_BYTES', r['memory']['total'], flush=True)")
    argvs = [json.dumps([dry_run_argv(layers, ac, device_type) for layers, ac in configs])]
    proc = subprocess.run([sys.executable, "-c", code, *argvs], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300 * len(configs))
    peaks = [int(ln.split()[1]) / GIB for ln in proc.stdout.splitlines() if ln.startswith("PEAK_BYTES")]
    if proc.returncode or len(peaks) != len(configs):
        raise RuntimeError(f"dry run failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return peaks


def layers_that_fit(capacity_gib: float, fill: float, device_type: str) -> tuple[int, dict]:
    """Memory is linear in the layer count: two dry runs give intercept and slope."""
    one, two = predict_peaks_gib([(1, "none"), (2, "none")], device_type)
    per_layer, fixed = two - one, 2 * one - two
    layers = max(1, math.floor((fill * capacity_gib - fixed) / per_layer))
    return layers, {"fixed_gib": fixed, "per_layer_gib": per_layer, "capacity_gib": capacity_gib, "fill": fill}


# ---------------------------------------------------------------- 3. throughput

CPU_SEQ = 128


def bench_args(args, layers: int, ac: str, compiled: bool, float8: str | None):
    return throughput.parse_args(bench_argv(args, layers, ac, compiled, float8))


def bench_argv(args, layers: int, ac: str, compiled: bool, float8: str | None) -> list[str]:
    """bench/throughput.py's options for one row."""
    gpu = args.device == "cuda"
    argv = ["--device", args.device, "--flavor", "8B" if gpu else "debug", "--layers", str(layers),
            "--seq-len", str(8192 if gpu else CPU_SEQ), "--batch", "1", "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--dtype", "bfloat16" if gpu else "float32", "--ac", ac]
    argv += ["--compile", "--compile-loss"] if compiled else []
    argv += ["--float8", "--float8-recipe", float8] if float8 else []
    return argv


def run_rows(args, layers: int, mesh, device, deadline: float, env: dict, profile_to: Path) -> tuple[list, float, int]:
    shape = throughput.new_model(bench_args(args, layers, "none", False, None))
    n = sum(p.numel() for p in shape.parameters())
    flops = model_flops_per_token(shape, shape.cfg.max_seq_len)  # train.py's MFU definition (physics/flops.py)
    spec = env["spec_tflops"] * 1e12 if env["spec_tflops"] else None
    matmul = env["matmul_tflops"] * 1e12
    est = {"step": 2.0, "compile": 120.0}  # seconds, refined by each measured variant
    rows = []
    for name in args.rows:
        ac, compiled, float8 = ROWS[name]
        row = {"name": name, "ac": ac, "compile": compiled, "float8": float8}
        rows.append(row)
        if float8:
            from meshtrain.parallel.float8 import float8_unavailable
            reason = float8_unavailable(device.type)
            if reason:
                row["skipped"] = reason
                continue
        steps = args.warmup + args.steps
        needed = 2 * ((est["compile"] if compiled else 15.0) + steps * est["step"])
        if time.perf_counter() + needed > deadline:
            row["skipped"] = f"time budget: about {needed:.0f} s needed, {deadline - time.perf_counter():.0f} s left"
            continue
        bargs = bench_args(args, layers, ac, compiled, float8)
        profile = profile_to if name == PROFILED_ROW else None
        print(f"gpu_check: {name} ...", flush=True)
        base = throughput.measure("baseline", throughput.build_baseline, bargs, mesh, device, flops, spec, compiled,
                                  profile_to=profile)
        ours = throughput.measure("meshtrain", throughput.build_meshtrain, bargs, mesh, device, flops, spec, compiled,
                                  profile_to=profile)
        measured = [v for v in (base, ours) if "error" not in v]
        if measured:
            est["step"] = max(v["step_seconds"] for v in measured)
            if compiled:  # the first variant compiles cold, the second may hit inductor's caches
                est["compile"] = max(v["warmup_seconds"] for v in measured)
        row["baseline"], row["meshtrain"] = base, ours
        if "error" in ours:
            row["error"] = ours["error"]
            continue
        tps = ours["tokens_per_second"]
        # Step-to-step spread of both variants, (max - min) / median: a ratio closer to 1
        # than this is noise.
        spread = max((max(v["step_times"]) - min(v["step_times"])) / sorted(v["step_times"])[len(v["step_times"]) // 2]
                     for v in measured)
        row.update(tokens_per_second=tps, tflops=tps * flops / 1e12, mfu_spec=tps * flops / spec if spec else None,
                   mfu_matmul=tps * flops / matmul, peak_mem_gib=ours["peak_memory_gib"],
                   peak_reserved_gib=ours.get("peak_reserved_gib"),
                   baseline_tokens_per_second=base.get("tokens_per_second"),
                   ratio=tps / base["tokens_per_second"] if "tokens_per_second" in base else None,
                   loss=ours["final_loss"], baseline_loss=base.get("final_loss"), step_spread=spread)
        print(f"gpu_check: {name}: {tps:,.0f} tokens/s, ratio {_num(row['ratio'], '.3f')}", flush=True)
    return rows, flops, n


# ---------------------------------------------------------------- 5. document masking

MASKING_SEQ_LENS = {"cuda": (2048, 8192), "cpu": (256,)}


def masking_rows(device: torch.device, deadline: float) -> list[dict]:
    """bench/document_masking.py's rows (causal vs masked tokens/s), or one row saying why
    not: skipped when under a minute of the budget is left, the error when it failed."""
    from bench import document_masking

    if deadline - time.perf_counter() < 60:
        return [{"skipped": "the --budget is spent"}]
    try:
        rows = document_masking.measure(device, MASKING_SEQ_LENS[device.type], steps=3 if device.type == "cuda" else 1)
    except Exception as err:  # a result like any other: recorded, the report still written
        return [{"error": f"{type(err).__name__}: {err}"}]
    for r in rows:
        print(f"gpu_check: document masking seq {r['seq_len']}: masked / causal {r['masked_over_causal']:.3f}",
              flush=True)
    return rows


def masked_training_runs(out: Path) -> dict:
    """CUDA: train.py with document masking (FlexAttention) under op-level activation
    checkpointing and under torch.compile, side by side: exit codes and losses."""
    env = subprocess_env()
    variants = {"ac_op": ("--activation_checkpoint.mode=op",), "compile": ("--compile.enable=true",)}
    procs = {name: subprocess.Popen(train_cmd("cuda", out, f"masked_{name}", "--training.document_masking=true",
                                              *flags), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name, flags in variants.items()}
    result = {}
    for name, proc in procs.items():
        log = proc.communicate(timeout=300)[0]
        result[name] = ({"losses": logged(out, f"masked_{name}")} if proc.returncode == 0 else
                        {"error": f"exit {proc.returncode}: {log[-1500:]}"})
    return result


# ---------------------------------------------------------------- 6. mixture of experts

# Qwen3-30B-A3B's shape cut to 3 blocks (1.87 B parameters) so fp32 master
# weights and AdamW state fit one 80 GB GPU; the flavor's own routing (top 8 of 128).
# 4 micro-batches of 2 x 4096 tokens a step: with one (8,192 tokens) the optimizer and the
# mixed-precision casts over all 1.87 B parameters -- work a real run's millions of tokens a
# step amortise -- took more of the step than the experts did.
MOE_STEP = ["--config", "moe_debug", "--model.flavor=qwen3_30b_a3b", "--model.n_layers=3", "--moe.top_k=8",
            "--moe.balance_loss_coef=0.001", "--moe.bias_update_rate=0", "--training.seq_len=4096",
            "--training.global_batch_size=8", "--training.local_batch_size=2", "--training.steps=12",
            "--training.mixed_precision_param=bfloat16", "--parallelism.dp_shard=1", "--parallelism.ep=1",
            "--metrics.log_freq=1"]


def moe_rows(device: torch.device, out: Path, deadline: float) -> dict:
    """The expert kernels side by side, then (CUDA) an MoE training step's tokens/s and MFU."""
    from bench import moe_grouped_mm

    if deadline - time.perf_counter() < 60:
        return {"skipped": "the --budget is spent"}
    cuda = device.type == "cuda"
    result = {}
    try:
        shapes = moe_grouped_mm.GPU_SHAPES if cuda else moe_grouped_mm.SHAPES[:1]
        result["kernels"] = moe_grouped_mm.measure(device, torch.bfloat16 if cuda else torch.float32, shapes,
                                                   repeats=5 if cuda else 1)
    except Exception as err:
        result["kernels_error"] = f"{type(err).__name__}: {err}"
    if not cuda:
        result["step"] = {"skipped": "CUDA only (the MoE step is tested on CPU by tests/test_parity.py)"}
        return result
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(ROOT / "train.py"),
           *MOE_STEP, "--job.device=cuda", f"--job.output_dir={out}", "--job.name=moe"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode:
        result["step"] = {"error": f"train.py exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"}
        return result
    steady = slice(2, None)  # the first two steps allocate and warm up
    tps, mfu = logged(out, "moe", "tokens_per_second")[steady], logged(out, "moe", "mfu")[steady]
    peak = logged(out, "moe", "peak_gib")[steady]
    result["step"] = {"seq_len": 4096, "batch": 8, "micro_batch": 2, "layers": 3, "steps_timed": len(tps),
                      "tokens_per_second": sorted(tps)[len(tps) // 2], "mfu_active": sorted(mfu)[len(mfu) // 2],
                      "peak_gib": max(peak), "losses": logged(out, "moe"),
                      "parameters_line": next((ln for ln in proc.stdout.splitlines() if "parameters" in ln), "")}
    # The dense twin: every block's FFN dense and 8 x 768 wide, so its active parameters
    # equal the MoE step's; what the experts' routing and dispatch cost shows as the ratio.
    dense = subprocess.run([*cmd[:-1], "--job.name=moe_dense", "--moe.n_dense_layers=3"], cwd=ROOT,
                           env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if dense.returncode:
        result["dense"] = {"error": f"train.py exited {dense.returncode}: {(dense.stdout + dense.stderr)[-2000:]}"}
        return result
    tps, mfu = logged(out, "moe_dense", "tokens_per_second")[steady], logged(out, "moe_dense", "mfu")[steady]
    result["dense"] = {"tokens_per_second": sorted(tps)[len(tps) // 2], "mfu": sorted(mfu)[len(mfu) // 2],
                       "peak_gib": max(logged(out, "moe_dense", "peak_gib")[steady]),
                       "parameters_line": next((ln for ln in dense.stdout.splitlines() if "parameters" in ln), "")}
    result["moe_over_dense"] = result["step"]["tokens_per_second"] / result["dense"]["tokens_per_second"]
    return result


def peer_rows(args, layers: int, deadline: float) -> dict:
    """meshtrain beside torchtitan (bench/peer_torchtitan.py) in bf16 and float8, or why not."""
    if args.device != "cuda":
        return {"skipped": "CUDA only (torchtitan builds its mesh on CUDA)"}
    try:
        from bench import peer_torchtitan
        version = peer_torchtitan.torchtitan_version()
    except Exception as err:  # not installed: it is no dependency of meshtrain
        return {"skipped": f"torchtitan does not import: {type(err).__name__}: {err}"}
    result = {"torchtitan": version, "rows": []}
    for name, float8 in (("bf16", None), ("float8 tensorwise", "tensorwise")):
        if deadline - time.perf_counter() < 240:  # four fresh processes, each compiling
            result["rows"].append({"name": name, "skipped": "the --budget is spent"})
            continue
        row = peer_torchtitan.compare(bench_argv(args, layers, "op", True, float8))
        result["rows"].append({"name": name, **row})
        print(f"gpu_check: peer {name}: meshtrain / torchtitan {_num(row['ratio'], '.3f')}", flush=True)
    return result


def kernel_speed_rows(device_type: str, out: Path) -> dict:
    """bench/kernel_speeds.py: matmul TFLOP/s per shape, attention and copy speeds, the
    planner's per-shape tables (also written to DIR/kernel_speeds.json)."""
    if device_type != "cuda":
        return {"skipped": "CUDA only (python -m bench.kernel_speeds --device cpu --quick is the smoke run)"}
    from bench import kernel_speeds
    try:
        return kernel_speeds.main(["--device", "cuda", "--out", str(out / "kernel_speeds.json")])
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def float8_speedup_rows(layers: int, deadline: float) -> dict:
    """float8 tensorwise over bf16 with 8 micro-batches a step (bench/float8_speedup.py): the
    optimizer's share of the step as on 8 GPUs, where the 1.25x target applies."""
    if deadline - time.perf_counter() < 240:  # four fresh processes, each compiling
        return {"skipped": "the --budget is spent"}
    from bench import float8_speedup
    try:
        return float8_speedup.measure("cuda", layers, [8], "tensorwise", steps=3, warmup=1)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def muon_step_lines(device_type: str) -> dict:
    """bench/muon_step.py's table on the GPU (its CPU numbers are scaled, and slow)."""
    if device_type != "cuda":
        return {"skipped": "CUDA only (python -m bench.muon_step measures CPU)"}
    proc = subprocess.run([sys.executable, "-m", "bench.muon_step", "--device", "cuda", "--ranks", "8"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    return {"lines": proc.stdout.strip().splitlines()}


# ---------------------------------------------------------------- 7. operations

def operations_checks(device_type: str, out: Path) -> dict:
    """[profiling]'s CUDA memory history, and the snapshot an out-of-memory error leaves."""
    import pickle

    if device_type != "cuda":
        return {"skipped": "CUDA only (the CPU profiler and the hang report are tested by the suite)"}
    env, result = subprocess_env(), {}
    window = ("--profiling.enable=true", "--profiling.start_step=5", "--profiling.steps=2")
    proc = subprocess.run(train_cmd("cuda", out, "profiled", *window), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    folder = out / "profiled" / "profile"
    trace, history = folder / "rank0_steps5-6.pt.trace.json", folder / "rank0_steps5-6_memory.pickle"
    result["profiled_exit"] = proc.returncode
    result["trace_has_steps"] = trace.exists() and '"meshtrain step 5"' in trace.read_text()
    if history.exists():
        snapshot = pickle.loads(history.read_bytes())
        result["history_events"] = sum(len(t) for t in snapshot.get("device_traces", []))
        result["history_segments"] = len(snapshot.get("segments", []))
    # 64 x 8192 tokens through 16 blocks of dim 2048: activations of terabytes, out of memory
    # inside the first forward, with a [profiling] window over that step to record the history.
    oom = ("--model.flavor=1B", "--model.vocab_size=512", "--training.seq_len=8192",
           "--training.global_batch_size=64", "--training.local_batch_size=64",
           "--profiling.enable=true", "--profiling.start_step=1", "--profiling.steps=1")
    proc = subprocess.run(train_cmd("cuda", out, "oom", *oom), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    snapshot_path = out / "oom" / "profile" / "rank0_oom.pickle"
    said = next((ln for ln in (proc.stdout + proc.stderr).splitlines() if "ran out of GPU memory" in ln), "")
    result["oom_exit"] = proc.returncode
    result["oom_message"] = said.split("meshtrain: ", 1)[-1].replace(str(out), "RUN")
    result["oom_message_names_file"] = "rank0_oom.pickle" in said
    if snapshot_path.exists():
        snapshot = pickle.loads(snapshot_path.read_bytes())
        result["oom_snapshot_segments"] = len(snapshot.get("segments", []))
        result["oom_snapshot_reserved_gib"] = sum(seg["total_size"] for seg in snapshot.get("segments", [])) / GIB
        result["oom_history_events"] = sum(len(t) for t in snapshot.get("device_traces", []))
    if not said:
        result["oom_tail"] = (proc.stdout + proc.stderr)[-1500:]
    return result


# ---------------------------------------------------------------- report

def markdown(result: dict) -> str:
    env = result["environment"]
    spec = f"{env['spec_tflops']:.0f}" if env["spec_tflops"] else "n/a"
    lines = [f"# gpu_check: {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}", "",
             f"Matmul {'8192^3 bf16' if env['memory_gib'] else '512^3 fp32'}: **{env['matmul_tflops']:.0f} TFLOP/s "
             f"measured**, spec {spec} TFLOP/s.", ""]
    c = result.get("checks")
    if c:
        lines += ["## train.py on one device", "",
                  f"- learns: **{c['learns']}** (loss {c['losses_fp32'][0]:.4f} -> {c['losses_fp32'][-1]:.4f} in 20 steps)",
                  f"- resume from the step-10 checkpoint is bitwise: **{c['resume_bitwise']}**",
                  f"- bf16 within 1e-2 of fp32: **{c['bf16_close']}** (largest relative loss difference "
                  f"{c['bf16_max_rel_diff']:.2e})", ""]
    s = result.get("shape")
    if s:
        lines += [f"## Throughput: {s['layers']} {s['flavor']} blocks ({s['params'] / 1e6:,.0f}M parameters), seq "
                  f"{s['seq_len']}, batch 1, {s['flops_per_token'] / 1e9:.4g} GFLOP/token", "",
                  "| row | tokens/s | TFLOP/s | MFU (spec) | MFU (matmul) | peak GiB | baseline tokens/s | ours / baseline "
                  "| step spread |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
        for r in result["runs"]:
            if "tokens_per_second" not in r:
                lines.append(f"| {r['name']} | {r.get('skipped') or r.get('error')} | | | | | | | |")
                continue
            base = r["baseline_tokens_per_second"]
            lines.append(f"| {r['name']} | {r['tokens_per_second']:,.0f} | {r['tflops']:.0f} | {pct(r['mfu_spec'])} | "
                         f"{pct(r['mfu_matmul'])} | {r['peak_mem_gib']:.1f} | "
                         f"{'OOM' if base is None else format(base, ',.0f')} | {_num(r['ratio'], '.3f')} | "
                         f"{pct(r['step_spread'])} |")
        lines.append("")
    if result.get("memory"):
        lines += ["## Dry-run peak vs measured (eager rows)", "",
                  "| row | predicted GiB | max allocated GiB | max reserved GiB | predicted / allocated |",
                  "|---|---:|---:|---:|---:|"]
        for m in result["memory"]:
            alloc = m["max_allocated_gib"]
            ratio = m["predicted_gib"] / alloc if alloc else None
            lines.append(f"| {m['name']} | {m['predicted_gib']:.2f} | {_num(alloc, '.2f')} | "
                         f"{_num(m['max_reserved_gib'], '.2f')} | {_num(ratio, '.3f')} |")
        lines.append("")
    if result.get("document_masking"):
        lines += ["## Document masking (packed documents vs causal)", "",
                  "| seq | documents / sequence | causal tokens/s | masked tokens/s | masked / causal "
                  "| SDPA bool mask tokens/s | SDPA mask / causal | flex vs SDPA (out, grad) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["document_masking"]:
            if "seq_len" not in r:
                lines.append(f"| {r.get('skipped') or r.get('error')} | | | | | | | |")
                continue
            agree = r.get("flex_vs_sdpa")
            agree = f"{agree['output_rel']:.1e}, {agree['grad_rel']:.1e}" if agree else "n/a"
            lines.append(f"| {r['seq_len']} | {r['documents_per_sequence']:.1f} | {r['causal_tokens_per_second']:,.0f} | "
                         f"{r['masked_tokens_per_second']:,.0f} | {r['masked_over_causal']:.3f} | "
                         f"{_num(r.get('masked_sdpa_tokens_per_second'), ',.0f')} | "
                         f"{_num(r.get('masked_sdpa_over_causal'), '.3f')} | "
                         f"{agree} |")
        lines.append("")
    moe = result.get("moe") or {}
    if moe.get("kernels"):
        lines += ["## Mixture of experts: one layer's experts, forward + backward (ms)", "",
                  "| tokens x k | dim | hidden | experts | max/mean | loop | grouped | padded |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in moe["kernels"]:
            lines.append(f"| {r['tokens']} x {r['top_k']} | {r['dim']} | {r['hidden']} | {r['experts']} | "
                         f"{r['max_over_mean']:.2f} | {_num(r['loop_ms'], '.1f')} | {_num(r['grouped_ms'], '.1f')} | "
                         f"{_num(r['padded_ms'], '.1f')} |")
        lines.append("")
    step = moe.get("step") or {}
    if "tokens_per_second" in step:
        lines += [f"MoE step (3 Qwen3-30B-A3B blocks, seq {step['seq_len']}, batch {step['batch']} in micro-batches of "
                  f"{step.get('micro_batch', step['batch'])}, bf16): "
                  f"**{step['tokens_per_second']:,.0f} tokens/s**, MFU on active parameters "
                  f"**{step['mfu_active']:.1f}%**, peak {step['peak_gib']:.1f} GiB.", ""]
    dense = moe.get("dense") or {}
    if "tokens_per_second" in dense:
        lines += [f"The same step with every block dense (FFN 6144 = 8 x 768, the same active size): "
                  f"{dense['tokens_per_second']:,.0f} tokens/s, MFU {dense['mfu']:.1f}%, peak "
                  f"{dense['peak_gib']:.1f} GiB; MoE / dense **{moe['moe_over_dense']:.2f}x**.", ""]
    elif dense:
        lines += [f"Dense twin failed: `{dense['error'].splitlines()[-1]}`", ""]
    if result.get("float8_curves", {}).get("runs"):
        from bench import float8_curves
        lines += float8_curves.markdown(result["float8_curves"])
    kernels = result.get("kernels") or {}
    if kernels.get("matmul"):
        lines += ["## Kernel speeds (bench/kernel_speeds.py)", "", "| m x k x n | TFLOP/s |", "|---|---:|"]
        lines += [f"| {r['m']} x {r['k']} x {r['n']} | {r['tflops']:.0f} |" for r in kernels["matmul"]]
        lines += ["", f"Copy {kernels['memory']['copy_gbs']:.0f} GB/s; attention (causal, d 128) " + ", ".join(
            f"{r['seq']}: {r['tflops']:.0f}" for r in kernels["attention"]) + " TFLOP/s by sequence.", ""]
    elif kernels:
        lines += [f"Kernel speeds: {kernels.get('skipped') or kernels.get('error')}", ""]
    speedup = result.get("float8_speedup") or {}
    if speedup.get("rows"):
        from bench import float8_speedup
        lines += ["## float8 over bf16, several micro-batches a step (bench/float8_speedup.py)", "",
                  *float8_speedup.markdown(speedup), ""]
    elif speedup:
        lines += [f"float8 over bf16 with micro-batches: {speedup.get('skipped') or speedup.get('error')}", ""]
    peer = result.get("peer") or {}
    if peer.get("rows"):
        lines += [f"## Side by side with torchtitan {peer['torchtitan']} (compiled, ac op)", "",
                  "| row | torchtitan tokens/s | meshtrain tokens/s | meshtrain / torchtitan |", "|---|---:|---:|---:|"]
        for r in peer["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['name']} | {r['skipped']} | | |")
                continue
            tps = lambda v: v.get("tokens_per_second")
            lines.append(f"| {r['name']} | {_num(tps(r['torchtitan']), ',.0f')} | {_num(tps(r['meshtrain']), ',.0f')} "
                         f"| {_num(r['ratio'], '.3f')} |")
        lines.append("")
    elif peer.get("skipped"):
        lines += [f"Side by side with torchtitan: skipped ({peer['skipped']}).", ""]
    if result.get("optimizer", {}).get("lines"):
        lines += ["## Optimizer step (bench/muon_step.py)", "", "```", *result["optimizer"]["lines"], "```", ""]
    ops = result.get("operations") or {}
    if "oom_exit" in ops:
        lines += ["## Operations", "",
                  f"- [profiling] window: trace lists the steps **{ops['trace_has_steps']}**; allocator history "
                  f"events {ops.get('history_events')}",
                  f"- out of memory: exit {ops['oom_exit']}, message names the snapshot "
                  f"**{ops['oom_message_names_file']}**; snapshot segments {ops.get('oom_snapshot_segments')}, "
                  f"history events {ops.get('oom_history_events')}", ""]
    for section, err in result.get("errors", {}).items():
        lines += [f"**{section} failed:** `{err.splitlines()[-1] if err else ''}`", ""]
    lines.append(f"Whole command: {result['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def save(result: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")


# ---------------------------------------------------------------- main

def main(argv=None) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train.py does
    args = parse_args(argv)
    started = time.perf_counter()
    deadline = started + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    store = throughput.init_world(args.device)
    if args.device == "cpu":
        torch.set_flush_denormal(True)  # see bench/throughput.py
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    env = environment(device)
    result = {"device": env["device"], "torch": env["torch"], "date": env["date"],
              "matmul_tflops": env["matmul_tflops"], "environment": env, "runs": [], "memory": [], "checks": {},
              "errors": {}}
    print(f"gpu_check: {env['device']} | torch {env['torch']} | CUDA {env['cuda']} | matmul "
          f"{env['matmul_tflops']:.1f} TFLOP/s measured, spec {env['spec_tflops']}", flush=True)
    save(result, args.out)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        if "checks" not in args.skip:
            try:
                result["checks"] = cuda_path_checks(args.device, work / "runs")
            except Exception as err:  # a failed check is a result: record it, measure the rest
                result["errors"]["checks"] = f"{type(err).__name__}: {err}"
            print(f"gpu_check: checks {({k: v for k, v in result['checks'].items() if not k.startswith('losses')})}",
                  flush=True)
            save(result, args.out)
        if "kernels" not in args.skip:
            result["kernels"] = kernel_speed_rows(args.device, args.out)
            save(result, args.out)
        capacity = env["memory_gib"]
        predictions = {}
        layers = args.layers or 2
        try:
            if not args.layers and args.device == "cuda":
                layers, result["layer_choice"] = layers_that_fit(capacity, args.fill, "cuda")
            if "memory" not in args.skip:
                modes = sorted({ROWS[name][0] for name in args.rows if not ROWS[name][1]})
                predictions = dict(zip(modes, predict_peaks_gib([(layers, ac) for ac in modes], args.device)))
        except Exception as err:  # the measurement still runs, at the default depth
            result["errors"]["dry run"] = f"{type(err).__name__}: {err}"
            layers = args.layers or (8 if args.device == "cuda" else 2)
        print(f"gpu_check: {layers} layers; predicted peaks (GiB) {predictions}", flush=True)
        if "throughput" not in args.skip:
            mesh = init_device_mesh(args.device, (1,), mesh_dim_names=("dp_shard",))
            rows, flops, n = run_rows(args, layers, mesh, device, deadline, env, args.out / "profile.txt")
            result["shape"] = {"flavor": "Llama-3-8B" if args.device == "cuda" else "debug Llama", "layers": layers, "params": n, "seq_len": 8192 if args.device == "cuda" else CPU_SEQ,
                               "flops_per_token": flops}
            result["runs"] = rows
            for r in rows:
                if r["name"].startswith("eager") and r["ac"] in predictions:
                    ours = r.get("meshtrain", {})
                    result["memory"].append({
                        "name": r["name"], "predicted_gib": predictions[r["ac"]],
                        "max_allocated_gib": ours.get("peak_memory_gib") if args.device == "cuda" else None,
                        "max_reserved_gib": ours.get("peak_reserved_gib")})
        if "document_masking" not in args.skip:
            result["document_masking"] = masking_rows(device, deadline)
            if args.device == "cuda":
                result["document_masking_runs"] = masked_training_runs(work / "masked")
                print(f"gpu_check: masked training runs {result['document_masking_runs']}", flush=True)
            save(result, args.out)
        if "moe" not in args.skip:
            result["moe"] = moe_rows(device, work / "moe", deadline)
            print(f"gpu_check: moe {result['moe']}", flush=True)
            save(result, args.out)
        if "float8" not in args.skip:
            if args.device != "cuda":
                result["float8_curves"] = {"skipped": "CUDA only (tests/test_float8.py checks float8 on CPU)"}
            elif deadline - time.perf_counter() < 90:
                result["float8_curves"] = {"skipped": "the --budget is spent"}
            else:
                from bench import float8_curves
                try:
                    result["float8_curves"] = float8_curves.run(work / "float8", subprocess_env())
                except Exception as err:
                    result["errors"]["float8"] = f"{type(err).__name__}: {err}"
                result["float8_speedup"] = float8_speedup_rows(layers, deadline)
            print(f"gpu_check: float8 curves {result.get('float8_curves', {}).get('runs', {}).keys()}", flush=True)
            save(result, args.out)
        if "optimizer" not in args.skip:
            try:
                result["optimizer"] = muon_step_lines(args.device)
            except Exception as err:
                result["errors"]["optimizer"] = f"{type(err).__name__}: {err}"
            print(f"gpu_check: optimizer {result.get('optimizer')}", flush=True)
            save(result, args.out)
        if "peer" not in args.skip:
            try:
                result["peer"] = peer_rows(args, layers, deadline)
            except Exception as err:
                result["errors"]["peer"] = f"{type(err).__name__}: {err}"
            save(result, args.out)
        if "operations" not in args.skip:
            try:
                result["operations"] = operations_checks(args.device, work / "ops")
            except Exception as err:
                result["errors"]["operations"] = f"{type(err).__name__}: {err}"
            print(f"gpu_check: operations {result.get('operations')}", flush=True)
            save(result, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        result["seconds"] = time.perf_counter() - started
        save(result, args.out)
        (args.out / "gpu_check.md").write_text(markdown(result))
        shutdown_distributed()
        if store and os.path.exists(store):
            os.remove(store)
    print(markdown(result), flush=True)
    return result


if __name__ == "__main__":
    main()
