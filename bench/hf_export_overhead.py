"""What `[checkpoint] export_hf_interval` costs a run: the same training, export off, every N
steps written on the step's path, and every N steps written in the background
(async_save), interleaved and repeated so a busy machine's noise falls on all alike.

    python bench/hf_export_overhead.py [--nproc 2] [--repeats 3] [--steps 20] [--every 5] [-- train.py overrides]

Each run is train.py under torchrun (CPU, gloo); reported per variant: the loop's seconds
per step (train.py's closing line: steps, export and waiting included) and the export
lines' own times (gather + write; in the background, the write ends after the step goes on).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# 1B's shapes with one block: 0.1 B parameters, 0.4 GB of fp32 weights to export, a step of seconds on CPU.
MODEL = ["--config", "debug_2d", "--model.flavor=1B", "--model.n_layers=1", "--training.seq_len=64",
         "--training.global_batch_size=4", "--parallelism.tp=1", "--metrics.enable_tensorboard=false",
         "--metrics.log_freq=1000"]


def run(nproc: int, steps: int, extra: list[str], out: Path, name: str) -> tuple[float, list[tuple[float, float]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", "train.py", *MODEL, f"--parallelism.dp_shard={nproc}",
           f"--training.steps={steps}", f"--job.output_dir={out}", f"--job.name={name}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    loop = float(re.search(r"done: steps 1-\d+ in ([\d.]+) s", proc.stdout).group(1))
    exports = [(float(t), float(g)) for t, g in
               re.findall(r"exported step \d+ to .* in ([\d.]+) s: gathered in ([\d.]+) s", proc.stdout)]
    return loop / steps, exports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    variants = {"off": [],
                f"every {args.every}, written on the step's path": [f"--checkpoint.export_hf_interval={args.every}"],
                f"every {args.every}, written in the background": [f"--checkpoint.export_hf_interval={args.every}",
                                                                   "--checkpoint.async_save=true"]}
    results = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, (name, extra) in enumerate(variants.items()):
                results[name].append(run(args.nproc, args.steps, [*extra, *args.overrides], Path(tmp), f"r{r}v{i}"))
    print(f"| variant ({args.nproc} processes, {args.steps} steps, {args.repeats} runs) | seconds per step, "
          "each run | median | an export, gather + write (median) | its gather (median) |")
    print("|---|---|---:|---:|---:|")
    for name, runs in results.items():
        per_step = [s for s, _ in runs]
        exports = [e for _, found in runs for e in found]
        whole = f"{statistics.median(t for t, _ in exports):.2f} s ({len(exports)} exports)" if exports else "-"
        gather = f"{statistics.median(g for _, g in exports):.2f} s" if exports else "-"
        print(f"| {name} | {' / '.join(f'{s:.3f}' for s in per_step)} | {statistics.median(per_step):.3f} | "
              f"{whole} | {gather} |")


if __name__ == "__main__":
    main()
