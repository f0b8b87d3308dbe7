"""bench/gpu_check.py's runs of train.py as a user runs it (subprocesses): the CUDA path's
checks, the dry run's predicted peaks, training with document masking, and the operations
checks (a profiling window, an out-of-memory run)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from meshtrain.physics.gpus import GIB

ROOT = Path(__file__).resolve().parent.parent
CPU_SEQ = 128  # the CPU smoke run's sequence (the GPU runs 8192)


# ---------------------------------------------------------------- 2. the CUDA path through train.py

def subprocess_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "2"}


def check_steps(device_type: str) -> int:
    """The CUDA path's runs train 20 steps and resume from the middle one; the CPU smoke run
    (the test suite's) 12, where CPU bf16 matmuls (no AVX-512 BF16: a scalar loop) are slow."""
    return 20 if device_type == "cuda" else 12


def train_cmd(device_type: str, out: Path, name: str, *extra: str) -> list[str]:
    # The CPU smoke run also trains on half the sequence: the same checks in less time; the
    # CUDA run keeps the config's length.
    shorter = ["--training.seq_len=64"] if device_type == "cpu" else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "train.py"), "--config", "debug_2d", f"--job.device={device_type}",
            "--parallelism.dp_shard=1", "--parallelism.tp=1", f"--training.steps={check_steps(device_type)}",
            "--metrics.log_freq=1",
            *shorter, f"--job.output_dir={out}", f"--job.name={name}", *extra]


def logged(out: Path, name: str, tag: str = "loss") -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / name / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def cuda_path_checks(device_type: str, out: Path) -> dict:
    """Three train.py runs (fp32 with a checkpoint halfway and at the end, bf16 beside it, then
    a run resumed from a copy of the halfway checkpoint), judged from their TensorBoard files."""
    env = subprocess_env()
    run = lambda cmd: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    steps = check_steps(device_type)
    half = steps // 2
    ckpt = ("--checkpoint.enable=true", f"--checkpoint.interval={half}")
    procs = {"fp32": run(train_cmd(device_type, out, "fp32", *ckpt)),
             "bf16": run(train_cmd(device_type, out, "bf16", "--training.mixed_precision_param=bfloat16"))}
    result, logs = {}, {}
    for name, proc in procs.items():
        logs[name] = proc.communicate(timeout=300)[0]
        if proc.returncode:
            raise RuntimeError(f"train.py ({name}) exited {proc.returncode}:\n{logs[name][-3000:]}")
    middle = out / "fp32" / "checkpoint" / f"step-{half:08d}"
    shutil.copytree(middle, out / "resumed" / "checkpoint" / middle.name)
    proc = run(train_cmd(device_type, out, "resumed", *ckpt, "--checkpoint.if_config_differs=resume"))
    logs["resumed"] = proc.communicate(timeout=300)[0]
    if proc.returncode or f"resumed at step {half}" not in logs["resumed"]:
        raise RuntimeError(f"train.py (resumed) did not resume at step {half}:\n{logs['resumed'][-3000:]}")
    fp32, bf16, resumed = (logged(out, n) for n in ("fp32", "bf16", "resumed"))
    result["steps"], result["resumed_at"] = steps, half
    result["losses_fp32"], result["losses_bf16"], result["losses_resumed"] = fp32, bf16, resumed
    result["learns"] = len(fp32) == steps and sum(fp32[-3:]) / 3 < 0.8 * fp32[0]
    norms, norms_resumed = logged(out, "fp32", "grad_norm"), logged(out, "resumed", "grad_norm")
    result["resume_bitwise"] = resumed == fp32[half:] and norms_resumed == norms[half:]
    rel = [abs(b - f) / abs(f) for b, f in zip(bf16, fp32)]
    result["bf16_max_rel_diff"] = max(rel)
    # Within 1e-2, yet not equal: equal losses would mean bf16 never reached the compute.
    result["bf16_close"] = len(bf16) == steps and max(rel) <= 1e-2 and max(rel) > 1e-6
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
