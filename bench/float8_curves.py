"""Float8 against bf16 over a real training run: `train.py` for 200 steps in bf16, in float8
tensorwise and in float8 rowwise, and in bf16 again with another seed -- the run-to-run
spread a float8 curve should stay inside.

    python -m bench.float8_curves --out /tmp/f8      # CUDA: four runs side by side on one GPU

The model is a small Llama (4 blocks, dim 1024, FFN 4096: widths float8's matmul accepts)
trained byte-level on Python's standard library at seq 2048, 8 sequences a step. Each run
is compared with the bf16 run of the same seed by the mean loss of its last 50 steps, the
part of the curve past the noise of the first steps. `bench/gpu_check.py` runs this as its
float8 section.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPE = ["--model.dim=1024", "--model.n_heads=16", "--model.n_kv_heads=8", "--model.ffn_hidden=4096",
         "--model.n_layers=4", "--training.seq_len=2048", "--training.global_batch_size=8"]
RUNS = {
    "bf16": [],
    "bf16_seed1": ["--training.seed=1"],
    "float8_tensorwise": ["--float8.enable=true", "--float8.recipe=tensorwise"],
    "float8_rowwise": ["--float8.enable=true", "--float8.recipe=rowwise"],
}
TAIL = 50


def command(out: Path, name: str, steps: int, device_type: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "train.py"), "--config", "debug_2d", f"--job.device={device_type}",
            "--parallelism.dp_shard=1", "--parallelism.tp=1", f"--training.steps={steps}",
            "--training.mixed_precision_param=bfloat16", "--lr_scheduler.warmup_steps=20", "--metrics.log_freq=1",
            *SHAPE, *RUNS[name], f"--job.output_dir={out}", f"--job.name={name}"]


def run(out: Path, env: dict, steps: int = 200, device_type: str = "cuda") -> dict:
    """The four runs at once (small: they share the GPU), judged from their TensorBoard files."""
    from bench.gpu_runs import logged

    out.mkdir(parents=True, exist_ok=True)
    procs = {name: subprocess.Popen(command(out, name, steps, device_type), cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in RUNS}
    result = {"steps": steps, "tail": TAIL, "runs": {}}
    for name, proc in procs.items():
        log = proc.communicate(timeout=420)[0]
        if proc.returncode:
            result["runs"][name] = {"error": f"exit {proc.returncode}: {log[-1500:]}"}
            continue
        losses, tps = logged(out, name), logged(out, name, "tokens_per_second")[2:]
        result["runs"][name] = {"losses": losses, "tail_mean": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
                                "tokens_per_second": sorted(tps)[len(tps) // 2] if tps else None}
    runs = result["runs"]
    if "tail_mean" in runs.get("bf16", {}):
        ref = runs["bf16"]["tail_mean"]
        for name, r in runs.items():
            if name != "bf16" and "tail_mean" in r:
                r["tail_rel_diff_vs_bf16"] = (r["tail_mean"] - ref) / ref
                r["max_step_rel_diff_vs_bf16"] = max(abs(a - b) / b for a, b in zip(r["losses"], runs["bf16"]["losses"]))
        spread = abs(runs.get("bf16_seed1", {}).get("tail_rel_diff_vs_bf16", float("nan")))
        for name in ("float8_tensorwise", "float8_rowwise"):
            if "tail_rel_diff_vs_bf16" in runs.get(name, {}):
                runs[name]["within_seed_spread"] = abs(runs[name]["tail_rel_diff_vs_bf16"]) <= spread
    return result


def markdown(result: dict) -> list[str]:
    lines = [f"## Float8 vs bf16 over {result['steps']} steps of train.py (4 blocks, dim 1024, seq 2048)", "",
             f"| run | mean loss, last {result['tail']} steps | vs bf16 | largest step difference | tokens/s |",
             "|---|---:|---:|---:|---:|"]
    for name, r in result["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error'].splitlines()[-1] if r['error'] else ''} | | | |")
            continue
        rel = r.get("tail_rel_diff_vs_bf16")
        step = r.get("max_step_rel_diff_vs_bf16")
        lines.append(f"| {name} | {r['tail_mean']:.4f} | {'' if rel is None else f'{100 * rel:+.2f}%'} | "
                     f"{'' if step is None else f'{100 * step:.2f}%'} | "
                     f"{'n/a' if r['tokens_per_second'] is None else format(r['tokens_per_second'], ',.0f')} |")
    return lines + [""]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from bench.gpu_runs import subprocess_env

    result = run(args.out, subprocess_env(), args.steps, args.device)
    (args.out / "float8_curves.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
