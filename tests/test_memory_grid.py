"""The planner's memory estimate is within 10% of the dry run's traced peak over a grid.

Each point is a layout the planner can write (`plan --write`): it is estimated
(planning.estimate, activations from the traced two-block probe of planning/activations.py),
written as a train.py config, and dry-run at its full world size on the pipeline rank
the estimate calls fullest (planning.verify.trace). The grid crosses TP 1-8, no pipeline
and pipelines of 2 and 4 ranks (1F1B, interleaved, GPipe with fewer micro-batches than
stages), every AC mode, FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD and NO_SHARD, on Llama 3
1B, 8B and 70B. Llama 3 405B at 512 ranks (pp 8
interleaved x tp 8, 30 of its blocks) is checked the same way in tests/test_dry_run.py, whose trace it
shares. bench/plan_vs_trace.py runs the larger searched grids of docs/planning.md
(minutes each, too long for the suite).

The estimate is not fitted to the trace: both count the same step, one block at a time
against the whole step, so a term missing on either side shows here (the check fails by
18-73% on every interleaved and 1F1B point when the estimate forgets that a stage stays
gathered with its fp32 gradients accumulating from its first backward to the step's end;
the GPipe point peaks at its first backward, before any stage has gradients).
"""

import pytest

from meshtrain.planning.estimate import estimate
from meshtrain.physics.gpus import GIB, get_gpu
from meshtrain.planning.plan import resolve_model
from meshtrain.parallel import ParallelDims
from meshtrain.planning.shape import Job
from meshtrain.planning.verify import trace

pytestmark = pytest.mark.slow  # each point traces a full-size model step at its world size

H100 = get_gpu("h100-80gb")


def job(model: str, nodes: int, seq: int, batch: int) -> Job:
    name, _, layers = model.partition("/")  # "70B/24": 70B's shape, 24 of its blocks
    return Job(resolve_model(name, **({"n_layers": int(layers)} if layers else {})), H100, nodes, 8, seq, batch)


def pipe(pp: int, m: int, v: int = 2, schedule: str = "Interleaved1F1B") -> dict:
    return dict(pp=pp, pp_schedule=schedule, pp_microbatches=m, stages_per_rank=v)


GRID = [  # (model, nodes, seq, global batch, layout)
    *[("8B", 1, 8192, 16, dict(tp=1, pp=1, dp_shard=8, micro_batch=2, ac=ac))
      for ac in ("none", "selective", "full", "op")],
    # The pipeline's own terms with and without recomputation (tp 1 above crosses every
    # AC mode). The interleaved points trace every block of a rank's two stages, so they
    # keep 16 of 8B's 32 blocks and 24 of 70B's 80 (a minute of tracing saved): each stage
    # still holds several blocks, and the check still fails on them as above.
    *[("8B/16", 1, 8192, 16, dict(tp=2, dp_shard=2, micro_batch=1, ac=ac, **pipe(2, 8)))
      for ac in ("none", "full")],
    ("8B", 1, 8192, 16, dict(tp=4, pp=1, dp_shard=2, micro_batch=8, ac="selective")),
    ("8B", 1, 8192, 16, dict(tp=4, pp=1, dp_shard=2, micro_batch=2, ac="none", strategy="SHARD_GRAD_OP")),
    ("8B", 2, 8192, 16, dict(tp=8, pp=1, dp_shard=2, micro_batch=8, ac="op")),
    ("8B", 2, 8192, 16, dict(tp=2, dp_shard=2, micro_batch=1, ac="full", **pipe(4, 8, v=1, schedule="1F1B"))),
    ("70B/24", 8, 8192, 128, dict(tp=2, dp_replicate=2, dp_shard=4, micro_batch=1, ac="full",
                               strategy="HYBRID_SHARD", **pipe(4, 16))),
    # Plain data parallelism (whole model states on every GPU), and GPipe with fewer
    # micro-batches than stages (every micro-batch in flight).
    ("1B", 1, 4096, 32, dict(tp=1, pp=1, dp_replicate=8, dp_shard=1, micro_batch=2, ac="full", strategy="NO_SHARD")),
    ("8B", 2, 8192, 4, dict(tp=2, dp_shard=2, micro_batch=1, ac="full", strategy="SHARD_GRAD_OP",
                            **pipe(4, 2, v=1, schedule="GPipe"))),
]


def _id(point) -> str:
    model, _, _, _, lay = point
    return f"{model.replace('/', '-')}-tp{lay['tp']}-pp{lay['pp']}-{lay['ac']}" + (f"-{lay['strategy']}" if "strategy" in lay else "")


@pytest.mark.parametrize("point", GRID, ids=[_id(p) for p in GRID])
def test_estimate_within_10_percent_of_the_traced_peak(point):
    model, nodes, seq, batch, lay = point
    j = job(model, nodes, seq, batch)
    e = estimate(j, ParallelDims(**{"strategy": "FULL_SHARD", "dp_replicate": 1, "world_size": j.world, **lay}))
    traced = trace(e, j)["memory"]["total"]
    assert traced == pytest.approx(e.memory.total, rel=0.10), \
        f"estimated {e.memory.total / GIB:.1f} GiB, traced {traced / GIB:.1f} GiB ({traced / e.memory.total - 1:+.0%})"
