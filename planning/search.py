"""The layout search: every layout train.py accepts for a job, those that fit in memory,
fastest first.

Enumerates tp inside a node x pp x dp_replicate x dp_shard, context parallelism inside the
node too for sequences of LONG_SEQ tokens or more, expert parallelism (ep out of dp_shard)
for a mixture of experts, micro-batch size, pipeline schedule and
micro-batches, activation checkpointing, FSDP strategy and, where a layout without a pipeline
accumulates gradients, whether it reduces them every micro-batch or once a step; checks each with the functions
train.py checks its config with; estimates the rest (planning/estimate.py).
"""

from __future__ import annotations

import itertools
from collections import Counter

from meshtrain.parallel.context_parallel import check_cp_fits
from meshtrain.parallel.fsdp import check_strategy
from meshtrain.parallel.layout import ParallelDims
from meshtrain.parallel.mesh import LayoutError, check_tp_fits
from meshtrain.parallel.vocabulary import AC_MODES, GRADIENT_SYNC, STRATEGIES, default_stages_per_rank
from meshtrain.physics.gpus import usable_bytes
from meshtrain.planning.activations import trace_probes
from meshtrain.planning.estimate import Estimate, estimate
from meshtrain.planning.forked import map_forked
from meshtrain.planning.memory import memory_per_gpu, probe_of
from meshtrain.planning.shape import PLANNED_SCHEDULES, Job

# Context parallelism is tried from this sequence length on: below it a sequence's
# activations fit beside the model states on one GPU, and cp only adds all-to-alls.
LONG_SEQ = 32_768


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(job: Job, lay: ParallelDims) -> None:
    """The rules train.py applies before starting, from the same functions; LayoutError if
    broken. (The degrees were checked when the layout was made; the pipeline rules run
    inside shares.rank_shares, via check_pipeline.)"""
    check_tp_fits(lay.tp, job.model.tp_divisible, seq_len=job.seq_len, gpus_per_node=job.gpus_per_node)
    problems = check_cp_fits(lay.cp, lay.tp, heads=job.model.n_heads, seq_len=job.seq_len, sequence_parallel=True)
    if problems:
        raise LayoutError("cp does not fit the model: " + "; ".join(problems))
    if job.global_batch % lay.dp:
        raise LayoutError(f"global batch {job.global_batch} is not divisible by dp = {lay.dp}")
    check_strategy(lay.strategy, lay.degrees)
    problems = lay.ep_problems(job.model.ep_divisible)  # the rules train.py applies to ep
    if problems:
        raise LayoutError("ep does not fit: " + "; ".join(problems))
    if lay.fsdp_shard == 1 and STRATEGIES[lay.strategy] != 0:
        raise LayoutError("no data-parallel sharding: model states would be held whole on every GPU")


def expert_degrees(job: Job, dp_shard: int, dp_replicate: int, cp: int, strategy: str) -> list[int]:
    """ep degrees to try: for a mixture of experts, each divisor of dp_shard that divides
    the routed experts, where the layout allows ep (FULL_SHARD or SHARD_GRAD_OP, no
    replicas, no cp: parallel/expert_parallel.py); 1 for everything else."""
    divisible = job.model.ep_divisible
    if not divisible or dp_replicate > 1 or cp > 1 or strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return [1]
    return [ep for ep in divisors(dp_shard) if all(n % ep == 0 for n in divisible.values())]


def syncs(pp: int, accumulation: int) -> tuple[str, ...]:
    """When gradients are reduced (parallel/vocabulary.py GRADIENT_SYNC): a pipeline always
    once a step; without one, after every micro-batch and, where there is more than one,
    once a step too (less traffic, 6 bytes per local parameter more memory)."""
    if pp > 1:
        return ("step",)
    return GRADIENT_SYNC if accumulation > 1 else ("microbatch",)


def candidates(job: Job):
    """Every layout to try (unchecked): tp (x cp, for long sequences) divides a node, pp and
    dp the rest."""
    for tp, cp in ((tp, cp) for tp in divisors(job.gpus_per_node)
                   for cp in (divisors(job.gpus_per_node // tp) if job.seq_len >= LONG_SEQ else (1,))):
        for pp in divisors(job.world // (tp * cp)):
            dp = job.world // (tp * cp * pp)
            for dp_replicate in divisors(dp):
                if dp == dp_replicate and cp == 1:
                    # No shard group: plain data parallelism (NO_SHARD, DDP), whole model
                    # states on every GPU, gradients all-reduced; with dp = 1 nothing to do.
                    strategies = ["NO_SHARD"] if dp > 1 else []
                else:  # the sharding strategies (ZeRO-3 and ZeRO-2), HYBRID with replicas
                    strategies = [s for s, zero in STRATEGIES.items()
                                  if zero and s.startswith("HYBRID") == (dp_replicate > 1)]
                local = job.global_batch // dp if job.global_batch % dp == 0 else 1
                schedules = ([(s, default_stages_per_rank(s)) for s in PLANNED_SCHEDULES] if pp > 1
                             else [("1F1B", 1)])
                for micro_batch in divisors(local):
                    for schedule, v in schedules:
                        if schedule == "GPipe" and local // micro_batch >= pp:
                            continue  # 1F1B runs it: the same bubble, fewer micro-batches in flight
                        for strategy in strategies:
                            for ep in expert_degrees(job, dp // dp_replicate, dp_replicate, cp, strategy):
                                for ac, sync in itertools.product(AC_MODES, syncs(pp, local // micro_batch)):
                                    yield ParallelDims(tp=tp, pp=pp, dp_replicate=dp_replicate,
                                                       dp_shard=dp // dp_replicate, cp=cp, ep=ep,
                                                       world_size=job.world, strategy=strategy, ac=ac,
                                                       micro_batch=micro_batch, gradient_sync=sync,
                                                       pp_schedule=schedule,
                                                       pp_microbatches=local // micro_batch if pp > 1 else 1,
                                                       stages_per_rank=v)


PIECE = 256  # layouts judged by one forked process at a time


def _rule(err: LayoutError) -> str:
    """The rule a rejected layout broke, as the rejections are counted: the message's head."""
    return str(err).split(":")[0]


def _judge(job: Job, lay: ParallelDims, budget: float) -> tuple[str, object]:
    """("rejected", the rule broken), ("fits", its estimate) or ("over", its peak bytes)."""
    try:
        total = memory_per_gpu(job, lay).total
    except LayoutError as err:
        return "rejected", _rule(err)
    return ("fits", estimate(job, lay)) if total <= budget else ("over", total)


def plan(job: Job, jobs: int | None = None) -> tuple[list[Estimate], Estimate | None, Counter]:
    """(the layouts that fit, fastest first; when none fits, the one needing the least
    memory; how many candidates each rule rejected). ``jobs``: processes at once (default:
    one per core, planning/forked.py)."""
    budget = usable_bytes(job.gpu)
    fitting, smallest, rejected, layouts = [], None, Counter(), []
    for lay in candidates(job):
        try:
            check_layout(job, lay)
        except LayoutError as err:
            rejected[_rule(err)] += 1
            continue
        layouts.append(lay)
    # The activation probes these layouts' memory reads, each traced once, then the layouts
    # themselves: both independent, one forked process per core (planning/forked.py).
    trace_probes((probe_of(job, lay) for lay in layouts), jobs)
    pieces = [layouts[i:i + PIECE] for i in range(0, len(layouts), PIECE)]
    judged = map_forked(lambda piece: [_judge(job, lay, budget) for lay in piece], pieces, jobs)
    for lay, (verdict, value) in zip(layouts, itertools.chain.from_iterable(judged)):
        if verdict == "rejected":
            rejected[value] += 1
        elif verdict == "fits":
            fitting.append(value)
        elif smallest is None or value < smallest[0]:
            smallest = (value, lay)
    # Ties (common: hidden FSDP traffic costs nothing here) go to less memory, then fewer bytes.
    fitting.sort(key=lambda e: (-e.tokens_per_s_per_gpu, e.memory.total, sum(e.comm_bytes.values())))
    return fitting, (estimate(job, smallest[1]) if not fitting and smallest else None), rejected
