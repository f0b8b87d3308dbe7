"""What [fault_tolerance] costs a step, measured on CPU (gloo): the same training -- two
replicas of FSDP over two ranks, the debug Llama -- run two ways, printed side by side:

    hsdp   one torchrun job of 4 ranks: dp_replicate 2 x dp_shard 2, HYBRID_SHARD (the
           replicas' gradients all-reduced by FSDP itself); a lost rank ends the job
    ft     two torchrun jobs of 2 ranks (replica groups) and torchft's lighthouse: the
           replicas' gradients averaged by torchft, a quorum and a commit every step

    python bench/fault_tolerance.py                  # about a minute on 2 cores
    python bench/fault_tolerance.py --steps 60 --seq-len 512

The step time is the median wall time between consecutive steps in each run's TensorBoard
(rank 0; of group 0 for ft), leaving out the first five (start-up, the first quorum).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "train.py", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def step_seconds(tb: Path) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    times = [e.wall_time for e in acc.Scalars("loss")][5:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    a = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="ft_bench_"))
    common = ["--config", "debug_2d", "--parallelism.tp=1", f"--training.steps={a.steps}",
              f"--training.seq_len={a.seq_len}", "--metrics.log_freq=1", f"--job.output_dir={out}"]

    hsdp = torchrun(4, *common, "--job.name=hsdp", "--parallelism.dp_replicate=2", "--parallelism.dp_shard=2",
                    "--parallelism.sharding_strategy=HYBRID_SHARD", log=out / "hsdp.log")
    assert hsdp.wait() == 0, (out / "hsdp.log").read_text()[-3000:]

    port = free_port()
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    lighthouse = subprocess.Popen([str(beside) if beside.exists() else shutil.which("torchft_lighthouse"),
                                   "--min_replicas", "1", "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"],
                                  stdout=open(out / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
    try:
        time.sleep(0.5)
        groups = [torchrun(2, *common, "--job.name=ft", "--parallelism.dp_shard=2", "--fault_tolerance.enable=true",
                           "--fault_tolerance.group_size=2", f"--fault_tolerance.replica_id={r}",
                           f"--fault_tolerance.lighthouse=http://localhost:{port}", log=out / f"ft{r}.log")
                  for r in range(2)]
        for r, g in enumerate(groups):
            assert g.wait() == 0, (out / f"ft{r}.log").read_text()[-3000:]
    finally:
        lighthouse.terminate()
        lighthouse.wait()

    plain, ft = step_seconds(out / "hsdp" / "tb"), step_seconds(out / "ft" / "replica_0" / "tb")
    print(f"debug Llama, global batch 8 x {a.seq_len} tokens, 2 replicas x FSDP 2, gloo on CPU, "
          f"median of steps 6-{a.steps}:")
    print(f"{'':>28} {'step (ms)':>10} {'vs hsdp':>8}")
    print(f"{'hsdp (one torchrun job)':>28} {plain * 1e3:>10.1f} {'':>8}")
    print(f"{'ft (torchft, two groups)':>28} {ft * 1e3:>10.1f} {ft / plain:>7.2f}x")
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
