"""Will it hang? Check before launch that every group's members issue the same collectives.

    meshtrain check --config llama405b_3d --world-size 512

A collective returns only when every member of its process group has called it with a
matching tensor. If one rank issues an all-reduce its peers do not (a rank-dependent
branch in a model, a stage that holds one layer more, a shape that differs by rank), the
job does not fail: it hangs until the NCCL watchdog kills it, often after a long queue.

Tracing all 512 ranks would take an hour; their programs fall into few roles
(planning/representative_ranks.py: which ranks are traced, and which traced rank every
other rank is derived from). Each traced rank's training step runs on fake tensors
(`planning.traced_step`, one micro-batch per stage: the sequence repeats per micro-batch)
while every collective is recorded in order (planning/collective_record.py): group,
operation, shape, dtype and the phase of the step that issued it. A stage of more than
three alike blocks is traced with three and its sequence expanded to all of them
(planning/alike_blocks.py). Then (planning/collective_compare.py):

1. every group of every dimension (torch's own list of them, kept by the fake world)
   must see the same sequence from each member; the first difference is reported with
   the group's lowest rank and the first member that differs, the op and the phase --
   what tracing every rank reports (`exhaustive=True` does, for small worlds), found in
   time linear in the world;
2. each pipeline stage must send what the next stage is built to receive (shape, dtype);
3. the schedule (torch's own list of each pp rank's forwards and backwards) is played
   out over all pp ranks with the stage placement the run uses: every receive must meet
   its send, or the ranks left waiting are named.

The traced ranks are independent: after rank 0, which gives the layout, they are traced in
one forked process per core (`jobs`, planning/forked.py). Asked for beside the dry run
(`meshtrain dry-run --check-collectives`), the whole check runs in a forked process of its
own while the dry run traces its rank (`check_collectives_later`).

What it cannot see: branches on data values (fake tensors have none) and an untraced rank
that behaves unlike the traced rank of its pp coordinate.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch.distributed as dist

from meshtrain.planning import forked
from meshtrain.planning.alike_blocks import BlockTags, collapse, expand
from meshtrain.planning.collective_compare import (_short, compare_groups, compare_stage_boundaries,
                                                   play_schedule)
from meshtrain.planning.collective_record import Call, RankTrace, RecordCollectives, partition
from meshtrain.planning.representative_ranks import coordinates, rank_of, representatives, stands_for

__all__ = ["Call", "RankTrace", "RecordCollectives", "partition", "coordinates", "rank_of", "representatives",
           "stands_for", "compare_groups", "compare_stage_boundaries", "play_schedule", "trace_rank",
           "trace_ranks", "check_collectives", "check_collectives_later"]


def one_microbatch(stage_ids: list[int]) -> list:
    """Each local stage's forward of micro-batch 0, then their backwards in reverse."""
    from meshtrain.planning.schedule import Action

    return [Action("F", s, 0) for s in stage_ids] + [Action("B", s, 0) for s in reversed(stage_ids)]


def trace_rank(cfg, world_size: int, rank: int, gpus_per_node: int, *,
               every_block: bool = False) -> tuple[RankTrace, object]:
    """Record the collectives of one training step of ``rank`` (and its layout). Stages of
    alike blocks are traced with three and expanded (planning/alike_blocks.py), unless
    ``every_block``: the reference the expansion is tested against."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshtrain.planning.collectives import mesh_group_names
    from meshtrain.planning.fake_world import init_fake_world
    from meshtrain.planning.traced_step import build_rank, trace_step
    from meshtrain.training import recipe

    init_fake_world(rank, world_size)
    try:
        tags, real = {}, {}  # kept block -> (stage, run, position); (stage, run) -> its real length

        def fewer_blocks(model, layout):
            built, kept, found = collapse(cfg, model, layout, periodic=True)
            tags.update(kept)
            real.update(found)
            return built

        model, layout, mesh, parts = build_rank(cfg, world_size, gpus_per_node,
                                                None if every_block else fewer_blocks)
        trace = RankTrace(rank, coordinates(layout, rank))
        modules = [part for _, part in parts]
        with FakeTensorMode(allow_non_fake_inputs=True):
            for m in modules:
                m.to_empty(device="cpu")
            optimizers, _ = recipe.build_optimizer(cfg, modules)
            block_tags = BlockTags(parts, tags)
            recorder = RecordCollectives(mesh_group_names(mesh), trace, tag=block_tags.current)
            with recorder, block_tags:
                actions = one_microbatch([s for s, _ in parts]) if layout.stage_layers else None
                trace_step(cfg, layout, mesh, parts, optimizers, model.cfg, recorder, None, actions)
            trace.stage_io = {s: io for s, io in recorder.stage_io.items()}
        trace.calls = {g: expand(calls, recorder.tags[g], real) for g, calls in trace.calls.items()}
    finally:
        dist.destroy_process_group()
    return trace, layout


def trace_ranks(cfg, world_size: int, ranks: list[int], gpus_per_node: int, *, every_block: bool = False,
                jobs: int | None = None) -> list[RankTrace]:
    """`trace_rank` of each of ``ranks``, in rank order, in ``jobs`` forked processes
    (planning/forked.py; None: one per core)."""
    return forked.map_forked(lambda rank: trace_rank(cfg, world_size, rank, gpus_per_node, every_block=every_block)[0],
                             ranks, jobs)


def check_collectives(cfg, world_size: int, gpus_per_node: int = 8, *, exhaustive: bool = False,
                      say=print, shown: int = 20, jobs: int | None = None) -> list[str]:
    """Trace the representative ranks (every rank, with every block, if ``exhaustive``:
    small worlds, the reference the derivations are tested against) and run the three checks; the problems
    found, each in one line (empty: no hang found). ``shown``: how many are printed. ``jobs``:
    processes tracing at once (default: one per core, planning/forked.py)."""
    from meshtrain.planning.fake_world import few_collections, one_thread

    started = time.perf_counter()
    with one_thread(), few_collections():
        first, layout = trace_rank(cfg, world_size, 0, gpus_per_node, every_block=exhaustive)
        ranks = list(range(world_size)) if exhaustive else representatives(layout)
        say(f"meshtrain collective check: tracing {len(ranks)} " +
            ("ranks (every one)" if exhaustive else f"representative ranks of {world_size}: {_short(ranks)}"))
        traces = [first] + trace_ranks(cfg, world_size, ranks[1:], gpus_per_node, every_block=exhaustive,
                                       jobs=jobs)
        problems = (compare_groups(traces, stands_for(layout, ranks)) + compare_stage_boundaries(traces)
                    + play_schedule(layout))
    n_groups = sum(int(rows.shape[0]) for rows in {lab: rows for t in traces for lab, rows in t.partitions.items()
                                                    if rows is not None}.values())
    n_calls = sum(len(c) for t in traces for c in t.calls.values())
    say(f"meshtrain collective check: {n_calls} collectives of {len(traces)} traced ranks, {n_groups} groups "
        f"compared in {time.perf_counter() - started:.0f} s; " +
        ("every group's members issue the same sequence" +
         (", every stage sends what the next receives and the schedule plays out without waiting forever"
          if layout.stage_layers else "") if not problems else f"{len(problems)} problem(s):"))
    for p in problems[:shown]:
        say(f"  HANG: {p}")
    if len(problems) > shown:
        say(f"  ... and {len(problems) - shown} more")
    return problems


@contextmanager
def check_collectives_later(cfg, world_size: int, gpus_per_node: int = 8, *, beside: bool = False,
                            jobs: int | None = None):
    """`check_collectives` for a caller with other work meanwhile (the dry run): yields a
    function returning its problems. With ``beside`` and ``jobs`` above one, the check
    starts now in a forked process (planning/forked.py `later`) and its lines are printed
    when its problems are taken, after the caller's; otherwise it runs then, here,
    printing as it goes. Beside the caller it still traces its ranks in ``jobs``
    processes: while both run they share the cores, and once the caller is done none is
    left idle (llama405b_3d at 512 ranks: about 13 s of CPU for the dry run, 19 s for the
    check)."""
    jobs = forked.default_jobs() if jobs is None else jobs
    if not beside or jobs <= 1:
        yield lambda: check_collectives(cfg, world_size, gpus_per_node, jobs=jobs)
        return

    def checked():
        lines: list[str] = []
        return check_collectives(cfg, world_size, gpus_per_node, say=lines.append, jobs=jobs), lines

    with forked.later(checked) as result:
        def problems() -> list[str]:
            found, lines = result()
            for line in lines:
                print(line, flush=True)
            return found

        yield problems
