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
12. loss (CUDA only, after the kernels): bench/loss_memory.py at Llama 3 8B's head (8,192
   tokens x 128,256 words): the default, compiled and chunked ([training] chunked_loss)
   cross-entropy's peak bytes per logit and time side by side.

The sections' code: bench/gpu_sections.py (measured in this process), bench/gpu_runs.py
(train.py runs as subprocesses), bench/gpu_report.py (gpu_check.md); this file runs them.

Writes DIR/gpu_check.json, DIR/gpu_check.md and DIR/profile.txt (the top kernels of one
compiled step). A row that would overrun ``--budget`` seconds is reported as skipped,
never half-measured; ``--rows`` picks rows by name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch
from torch.distributed.device_mesh import init_device_mesh

from bench import throughput
from bench.gpu_report import markdown
from bench.gpu_runs import (CPU_SEQ, cuda_path_checks, layers_that_fit, masked_training_runs, operations_checks,
                            predict_peaks_gib, subprocess_env)
from bench.gpu_sections import (ROWS, environment, float8_speedup_rows, kernel_speed_rows, loss_memory_rows,
                                 masking_rows, moe_rows, muon_step_lines, peer_rows, run_rows)
from meshtrain.parallel.mesh import shutdown_distributed


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
                   "document_masking, moe, operations, float8, optimizer, peer, kernels, loss")
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
        if "loss" not in args.skip:
            result["loss"] = loss_memory_rows(args.device)
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
