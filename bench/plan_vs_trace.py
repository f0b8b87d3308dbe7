"""The planner's memory estimate against the dry run's traced peak, over a grid of layouts.

    python bench/plan_vs_trace.py --model 8B --nodes 1 --seq-len 8192 --global-batch 16
    python bench/plan_vs_trace.py --model 70B --nodes 8 --seq-len 8192 --global-batch 512 --tp 2,8 --pp 1,4

For every (tp, pp, AC mode) of the grid, the fastest layout the search finds with those
three that fits (the smallest if none does; the other knobs as it chose them) is written as a train.py config, as `plan
--write` does, and dry-run at the full world size on the pipeline rank the estimate says
is fullest. Prints estimate, trace and their difference, one row per layout: what the
planner's +-10% target is checked against. No GPU; tens of seconds per 70B trace.
"""

from __future__ import annotations

import argparse
import time


from meshtrain.parallel.mesh import LayoutError
from meshtrain.planning.estimate import estimate
from meshtrain.physics.gpus import GIB, get_gpu, usable_bytes
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.report import describe
from meshtrain.parallel.vocabulary import AC_MODES
from meshtrain.planning.search import candidates, check_layout
from meshtrain.planning.shape import Job
from meshtrain.planning.verify import trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="8B")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--tp", default="1,2,4,8")
    p.add_argument("--pp", default="1,2")
    p.add_argument("--ac", default=",".join(AC_MODES))
    args = p.parse_args()
    job = Job(resolve_model(args.model), get_gpu(args.gpu), args.nodes, args.gpus_per_node, args.seq_len,
              args.global_batch)
    print(f"{job.model.family} {job.model.flavor} on {job.nodes} x {job.gpus_per_node}, seq {job.seq_len}, "
          f"global batch {job.global_batch}: estimate vs dry-run trace, GiB per GPU")
    rows, usable = [], usable_bytes(job.gpu)
    for tp in map(int, args.tp.split(",")):
        for pp in map(int, args.pp.split(",")):
            for ac in args.ac.split(","):
                best = None
                for lay in candidates(job):
                    if (lay.tp, lay.pp, lay.ac) != (tp, pp, ac):
                        continue
                    try:
                        check_layout(job, lay)
                        e = estimate(job, lay)
                    except LayoutError:  # a layout the search would reject
                        continue
                    # The fastest that fits; while none fits, the smallest.
                    key = lambda x: ((x.memory.total <= usable), x.tokens_per_s_per_gpu if
                                     x.memory.total <= usable else -x.memory.total)
                    if best is None or key(e) > key(best):
                        best = e
                if best is None:
                    continue
                t0 = time.perf_counter()
                traced, est = trace(best, job)["memory"]["total"], best.memory.total
                rows.append((describe(best.layout), est, traced))
                print(f"  {describe(best.layout):<95} {est / GIB:6.1f} {traced / GIB:6.1f} "
                      f"{traced / est - 1:+6.0%}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    worst = max(rows, key=lambda r: abs(r[2] / r[1] - 1))
    within = sum(abs(r[2] / r[1] - 1) <= 0.10 for r in rows)
    print(f"{within} of {len(rows)} within 10%; the largest difference {worst[2] / worst[1] - 1:+.0%}: {worst[0]}")


if __name__ == "__main__":
    main()
