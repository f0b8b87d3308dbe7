"""bench/gpu_check.py's measurements in its own process: the environment, the throughput
rows (meshtrain beside a plain-torch loop), document masking's kernels, the MoE kernels and
step, and the benchmarks it runs in fresh processes (peer, float8 speed-up, kernel speeds,
Muon's step)."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import throughput
from bench.gpu_report import _num
from bench.gpu_runs import CPU_SEQ, ROOT, logged, subprocess_env
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


# ---------------------------------------------------------------- 3. throughput



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


def loss_memory_rows(device_type: str) -> dict:
    """bench/loss_memory.py at Llama 3 8B's head (8,192 tokens x 128,256 words): the
    default, compiled and chunked cross-entropy's peak memory and time side by side."""
    if device_type != "cuda":
        return {"skipped": "CUDA only (python -m bench.loss_memory measures CPU)"}
    from bench import loss_memory
    try:
        return loss_memory.measure("cuda", tokens=8192, vocab=128256, repeats=5)
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
