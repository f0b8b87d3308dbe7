"""Will it hang? Check before launch that every group's members issue the same collectives.

    meshtrain check --config llama405b_3d --world-size 512

A collective returns only when every member of its process group has called it with a
matching tensor. If one rank issues an all-reduce its peers do not (a rank-dependent
branch in a model, a stage that holds one layer more, a shape that differs by rank), the
job does not fail: it hangs until the NCCL watchdog kills it, often after a long queue.

Tracing all 512 ranks would take an hour; their programs fall into few classes. Under a
pipeline each pp coordinate runs different layers, so every pp coordinate is traced; in
the other dimensions the ranks run the same program on different data, so one more rank
is traced per dimension of size > 1, at the last coordinate of that dimension (it shares
every group of that dimension with a traced rank), and the world's last rank. Each one's
training step runs on fake tensors (`planning.traced_step`, one micro-batch per stage: the
sequence repeats per micro-batch) while every collective is recorded in order: group,
operation, shape, dtype and the phase of the step that issued it. Then:

1. each group's traced members must issue the same sequence; the first difference is
   reported with both ranks, the op and the phase;
2. each pipeline stage must send what the next stage is built to receive (shape, dtype);
3. the schedule (torch's own list of each pp rank's forwards and backwards) is played
   out over all pp ranks with the stage placement the run uses: every receive must meet
   its send, or the ranks left waiting are named.

What it cannot see: branches on data values (fake tensors have none) and ranks outside
the traced classes that behave differently from their class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.parallel.vocabulary import DIM_NAMES, WHOLE_BACKWARD
from meshtrain.planning.collectives import CountCollectives


@dataclass(frozen=True)
class Call:
    """One collective as issued: what must match across the group, and where it came from."""
    kind: str
    shape: tuple
    dtype: str
    phase: str

    def describe(self) -> str:
        return f"{self.kind} of {list(self.shape)} {self.dtype} during the {self.phase}"


@dataclass
class RankTrace:
    rank: int
    coords: dict[str, int]
    calls: dict[tuple, list[Call]] = field(default_factory=dict)  # group members -> calls in order
    labels: dict[tuple, str] = field(default_factory=dict)        # group members -> mesh dimension(s)
    stage_io: dict[int, tuple] = field(default_factory=dict)      # stage -> (input, output) (shape, dtype)


class RecordCollectives(CountCollectives):
    """CountCollectives that also keeps, per process group, the ordered list of calls."""

    def __init__(self, group_names, trace: RankTrace):
        super().__init__(group_names)
        self.trace, self.members = trace, {}

    def on_collective(self, kind: str, payload: torch.Tensor, args) -> None:
        members = self._members(args)
        self.trace.labels.setdefault(members, self._group(args)[0])
        self.trace.calls.setdefault(members, []).append(
            Call(kind, tuple(payload.shape), str(payload.dtype).replace("torch.", ""), self.phase))
        super().on_collective(kind, payload, args)

    def _members(self, args) -> tuple:
        from torch.distributed.distributed_c10d import _resolve_process_group

        for a in args:
            pg = None
            if isinstance(a, str):
                try:
                    pg = _resolve_process_group(a)
                except Exception:
                    continue
            elif type(a).__name__ == "ScriptObject":
                try:
                    pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
                except Exception:
                    continue
            if pg is not None:
                if pg.group_name not in self.members:
                    self.members[pg.group_name] = tuple(dist.get_process_group_ranks(pg))
                return self.members[pg.group_name]
        raise RuntimeError(f"collective without a process group among its arguments: {args!r:.200}")


# ---------------------------------------------------------------- which ranks

def coordinates(dims, rank: int) -> dict[str, int]:
    out = {}
    for name in reversed(DIM_NAMES):  # the last dimension varies fastest
        size = getattr(dims, name)
        rank, out[name] = divmod(rank, size)
    return {name: out[name] for name in DIM_NAMES}


def rank_of(dims, coords: dict[str, int]) -> int:
    rank = 0
    for name in DIM_NAMES:
        rank = rank * getattr(dims, name) + coords.get(name, 0)
    return rank


def representatives(dims) -> list[int]:
    """Every pp coordinate (others at 0); the last coordinate of each other dimension of
    size > 1 (others at 0); the world's last rank."""
    ranks = [rank_of(dims, {"pp": p}) for p in range(dims.pp)]
    ranks += [rank_of(dims, {d: getattr(dims, d) - 1}) for d in DIM_NAMES[1:] if getattr(dims, d) > 1]
    ranks.append(dims.world_size - 1)
    return list(dict.fromkeys(ranks))


# ---------------------------------------------------------------- tracing

def one_microbatch(stage_ids: list[int]) -> list:
    """Each local stage's forward of micro-batch 0, then their backwards in reverse."""
    from meshtrain.planning.schedule import Action

    return [Action("F", s, 0) for s in stage_ids] + [Action("B", s, 0) for s in reversed(stage_ids)]


def trace_rank(cfg, world_size: int, rank: int, gpus_per_node: int) -> tuple[RankTrace, object]:
    """Record the collectives of one training step of ``rank`` (and its layout)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshtrain.planning.collectives import mesh_group_names
    from meshtrain.planning.fake_world import init_fake_world
    from meshtrain.planning.traced_step import build_rank, trace_step
    from meshtrain.training import recipe

    init_fake_world(rank, world_size)
    try:
        model, layout, mesh, parts = build_rank(cfg, world_size, gpus_per_node)
        trace = RankTrace(rank, coordinates(layout, rank))
        modules = [part for _, part in parts]
        with FakeTensorMode(allow_non_fake_inputs=True):
            for m in modules:
                m.to_empty(device="cpu")
            optimizers, _ = recipe.build_optimizer(cfg, modules)
            recorder = RecordCollectives(mesh_group_names(mesh), trace)
            with recorder:
                actions = one_microbatch([s for s, _ in parts]) if layout.stage_layers else None
                trace_step(cfg, layout, mesh, parts, optimizers, model.cfg, recorder, None, actions)
            trace.stage_io = {s: io for s, io in recorder.stage_io.items()}
    finally:
        dist.destroy_process_group()
    return trace, layout


# ---------------------------------------------------------------- checks

def compare_groups(traces: list[RankTrace]) -> list[str]:
    """The first difference in each group between two of its traced members."""
    problems = []
    groups = {g for t in traces for g in t.calls}
    for members in sorted(groups, key=lambda g: (len(g), g)):
        traced = [t for t in traces if t.rank in members]
        if len(traced) < 2:
            continue
        first = traced[0]
        label = first.labels.get(members) or next(t.labels[members] for t in traced if members in t.labels)
        for other in traced[1:]:
            problem = _first_difference(first, other, members)
            if problem:
                problems.append(f"{label} group {_short(members)}: {problem}")
                break
    return problems


def _first_difference(a: RankTrace, b: RankTrace, members: tuple) -> str:
    ca, cb = a.calls.get(members, []), b.calls.get(members, [])
    for i, (x, y) in enumerate(zip(ca, cb)):
        if (x.kind, x.shape, x.dtype) != (y.kind, y.shape, y.dtype):
            return (f"call #{i + 1} differs: rank {a.rank} issues {x.describe()}; "
                    f"rank {b.rank} issues {y.describe()}")
    if len(ca) != len(cb):
        more, fewer = (a, b) if len(ca) > len(cb) else (b, a)
        extra = (ca if more is a else cb)[min(len(ca), len(cb))]
        return (f"rank {more.rank} issues {abs(len(ca) - len(cb))} more call(s) than rank {fewer.rank} "
                f"({max(len(ca), len(cb))} against {min(len(ca), len(cb))}); the first unmatched is "
                f"call #{min(len(ca), len(cb)) + 1}: {extra.describe()}; rank {fewer.rank} would wait there forever")
    return ""


def compare_stage_boundaries(traces: list[RankTrace]) -> list[str]:
    io = {s: v for t in traces for s, v in t.stage_io.items()}
    problems = []
    for s in sorted(io):
        if s + 1 in io and io[s][1] != io[s + 1][0]:
            problems.append(f"pipeline stage {s} sends {io[s][1]} but stage {s + 1} is built to receive "
                            f"{io[s + 1][0]} (shape, dtype)")
    return problems


def play_schedule(layout) -> list[str]:
    """Run every pp rank's list of forwards and backwards (torch's schedule IR) against
    each other: a forward waits for the previous stage's forward of its micro-batch, a
    backward for the next stage's backward; stages sit on the ranks `stage_ids` puts them."""
    from meshtrain.parallel.pipeline import stage_ids
    from meshtrain.planning.schedule import Deadlock, play, rank_actions

    if layout.stage_layers is None:
        return []
    pp, n_stages = layout.pp, len(layout.stage_layers)
    if layout.pp_schedule not in WHOLE_BACKWARD:
        return []  # no F/B model for the zero-bubble schedules; the groups were still compared
    lists = rank_actions(layout.pp_schedule, pp, layout.stages_per_rank, layout.pp_microbatches)
    problems = []
    for r, actions in enumerate(lists):
        held = set(stage_ids(r, pp, n_stages, layout.placement))
        stray = sorted({a.stage for a in actions} - held)
        if stray:
            problems.append(f"the {layout.pp_schedule} schedule runs stage(s) {stray} on pp rank {r}, which holds "
                            f"stages {sorted(held)} ({layout.placement} placement)")
    if problems:
        return problems
    try:
        play(lists, n_stages)
    except Deadlock as stuck:
        waiting = [f"pp rank {r} at its {'forward' if a.kind == 'F' else 'backward'} of stage {a.stage}, "
                   f"micro-batch {a.microbatch}" for r, a in stuck.waiting]
        return [f"the {layout.pp_schedule} schedule deadlocks: " + "; ".join(waiting) + " wait for each other"]
    return []


def check_collectives(cfg, world_size: int, gpus_per_node: int = 8, *, ranks: list[int] | None = None,
                      say=print) -> list[str]:
    """Trace the representative ranks (or ``ranks``) and run the three checks; the
    problems found, each in one line (empty: no hang found)."""
    started = time.perf_counter()
    first, layout = trace_rank(cfg, world_size, (ranks or [0])[0], gpus_per_node)
    ranks = ranks or representatives(layout)
    say(f"meshtrain collective check: tracing {len(ranks)} representative ranks of {world_size}: {_short(ranks)}")
    traces = [first]
    for rank in ranks[1:]:
        traces.append(trace_rank(cfg, world_size, rank, gpus_per_node)[0])
    problems = compare_groups(traces) + compare_stage_boundaries(traces) + play_schedule(layout)
    n_groups = len({g for t in traces for g in t.calls})
    n_calls = sum(len(c) for t in traces for c in t.calls.values())
    say(f"meshtrain collective check: {n_calls} collectives in {n_groups} groups recorded "
        f"in {time.perf_counter() - started:.0f} s; " +
        ("every group's traced members issue the same sequence" +
         (", every stage sends what the next receives and the schedule plays out without waiting forever"
          if layout.stage_layers else "") if not problems else f"{len(problems)} problem(s):"))
    for p in problems:
        say(f"  HANG: {p}")
    return problems


def _short(values) -> str:
    values = list(values)
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}] ({len(values)})"
