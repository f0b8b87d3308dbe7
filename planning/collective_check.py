"""Will it hang? Check before launch that every group's members issue the same collectives.

    meshtrain check --config llama405b_3d --world-size 512

A collective returns only when every member of its process group has called it with a
matching tensor. If one rank issues an all-reduce its peers do not (a rank-dependent
branch in a model, a stage that holds one layer more, a shape that differs by rank), the
job does not fail: it hangs until the NCCL watchdog kills it, often after a long queue.

Tracing all 512 ranks would take an hour; their programs fall into few roles. Under a
pipeline each pp coordinate runs different layers: its role. In the other dimensions the
ranks run the same program on different data. So one rank per pp coordinate is traced,
plus one per dimension of size > 1 at the last coordinate of that dimension (where uneven
shards would show) and the world's last rank. Each one's training step runs on fake
tensors (`planning.traced_step`, one micro-batch per stage: the sequence repeats per
micro-batch) while every collective is recorded in order: group, operation, shape, dtype
and the phase of the step that issued it. Every other rank issues, in each of its groups,
what the traced rank of its pp coordinate issues in that rank's group of the same
dimension. Then:

1. every group of every dimension (torch's own list of them, kept by the fake world)
   must see the same sequence from each member; the first difference is reported with
   the group's lowest rank and the first member that differs, the op and the phase --
   what tracing every rank reports (`exhaustive=True` does, for small worlds), found in
   time linear in the world;
2. each pipeline stage must send what the next stage is built to receive (shape, dtype);
3. the schedule (torch's own list of each pp rank's forwards and backwards) is played
   out over all pp ranks with the stage placement the run uses: every receive must meet
   its send, or the ranks left waiting are named.

What it cannot see: branches on data values (fake tensors have none) and an untraced rank
that behaves unlike the traced rank of its pp coordinate.
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
    partitions: dict[str, torch.Tensor] = field(default_factory=dict)  # dimension -> all its groups, a row each
    stage_io: dict[int, tuple] = field(default_factory=dict)      # stage -> (input, output) (shape, dtype)


class RecordCollectives(CountCollectives):
    """CountCollectives that also keeps, per process group, the ordered list of calls."""

    def __init__(self, group_names, trace: RankTrace):
        super().__init__(group_names)
        self.trace, self.members, self.partition_of = trace, {}, {}

    def on_collective(self, kind: str, payload: torch.Tensor, args) -> None:
        members = self._members(args)
        label = self.trace.labels.setdefault(members, self._group(args)[0])
        if label not in self.trace.partitions:
            self.trace.partitions[label] = self.partition_of[members]
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
                    members = tuple(dist.get_process_group_ranks(pg))
                    self.members[pg.group_name] = members
                    self.partition_of[members] = partition(pg.group_name, members)
                return self.members[pg.group_name]
        raise RuntimeError(f"collective without a process group among its arguments: {args!r:.200}")


def partition(group_name: str, members: tuple) -> torch.Tensor | None:
    """Every group of the dimension ``group_name`` was made for, a row each (the fake
    world keeps them as the mesh makes its groups); the world for the default group; None
    for a group made outside a mesh (its traced members are compared among themselves)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from meshtrain.planning.fake_world import partitions

    if group_name in partitions:
        return partitions[group_name]
    if len(members) == dist.get_world_size():
        with unset_fake_temporarily():  # met inside the traced step
            return torch.arange(len(members)).unsqueeze(0)
    return None


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


def stands_for(dims, traced: list[int]) -> torch.Tensor:
    """For every rank, the traced rank whose program it runs: itself if traced, else the
    first rank of its pp coordinate (pp is the outermost mesh dimension)."""
    per_stage = dims.world_size // dims.pp
    source = torch.arange(dims.world_size) // per_stage * per_stage
    source[torch.tensor(traced)] = torch.tensor(traced)
    return source


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

def compare_groups(traces: list[RankTrace], source: torch.Tensor) -> list[str]:
    """The first difference in each group, over every group of every dimension: a rank
    issues what the traced rank ``source[rank]`` issues in its group of that dimension.
    Groups are sorted by size then members; each is compared from its lowest rank, against
    the members in rank order -- with every rank traced and ``source`` the identity, what
    comparing each group's traced members one by one gives."""
    by_rank = {t.rank: t for t in traces}
    found = []  # (members, problem)
    partitions = {}
    for t in traces:
        for label, rows in t.partitions.items():
            if rows is not None:
                partitions.setdefault(label, rows)
    for label, rows in partitions.items():
        calls, ids = {}, {}  # traced rank -> its calls in its group of `label`; sequence -> id
        seq_id = torch.full((len(source),), -1, dtype=torch.long)
        for t in traces:
            members = next((m for m, lab in t.labels.items() if lab == label), None)
            calls[t.rank] = t.calls.get(members, []) if members is not None else []
            key = tuple((c.kind, c.shape, c.dtype) for c in calls[t.rank])
            seq_id[t.rank] = ids.setdefault(key, len(ids))
        if len(ids) == 1:
            continue  # every traced rank issues the same here: so does every rank
        ordered = rows.sort(dim=1).values
        got = seq_id[source[ordered]]
        for row in (got != got[:, :1]).any(dim=1).nonzero().flatten().tolist():
            col = int((got[row] != got[row, 0]).nonzero()[0])
            a, b = int(ordered[row, 0]), int(ordered[row, col])
            problem = _first_difference(a, calls[int(source[a])], b, calls[int(source[b])])
            found.append((tuple(rows[row].tolist()), f"{label} group {_short(rows[row].tolist())}: {problem}"))
    # Groups made outside a mesh: their traced members, one against the other.
    for members in {g for t in traces for g, lab in t.labels.items() if t.partitions.get(lab) is None}:
        traced = sorted(r for r in members if r in by_rank)
        for other in traced[1:]:
            problem = _first_difference(traced[0], by_rank[traced[0]].calls.get(members, []),
                                        other, by_rank[other].calls.get(members, []))
            if problem:
                label = by_rank[traced[0]].labels.get(members) or by_rank[other].labels[members]
                found.append((members, f"{label} group {_short(members)}: {problem}"))
                break
    return [problem for _, problem in sorted(found, key=lambda f: (len(f[0]), f[0]))]


def _first_difference(rank_a: int, ca: list, rank_b: int, cb: list) -> str:
    for i, (x, y) in enumerate(zip(ca, cb)):
        if (x.kind, x.shape, x.dtype) != (y.kind, y.shape, y.dtype):
            return (f"call #{i + 1} differs: rank {rank_a} issues {x.describe()}; "
                    f"rank {rank_b} issues {y.describe()}")
    if len(ca) != len(cb):
        (more, cm), (fewer, _) = ((rank_a, ca), (rank_b, cb)) if len(ca) > len(cb) else ((rank_b, cb), (rank_a, ca))
        extra = cm[min(len(ca), len(cb))]
        return (f"rank {more} issues {abs(len(ca) - len(cb))} more call(s) than rank {fewer} "
                f"({max(len(ca), len(cb))} against {min(len(ca), len(cb))}); the first unmatched is "
                f"call #{min(len(ca), len(cb)) + 1}: {extra.describe()}; rank {fewer} would wait there forever")
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


def check_collectives(cfg, world_size: int, gpus_per_node: int = 8, *, exhaustive: bool = False,
                      say=print, shown: int = 20) -> list[str]:
    """Trace the representative ranks (every rank if ``exhaustive``: small worlds, the
    reference the derivation is tested against) and run the three checks; the problems
    found, each in one line (empty: no hang found). ``shown``: how many are printed."""
    from meshtrain.planning.fake_world import one_thread

    started = time.perf_counter()
    with one_thread():
        first, layout = trace_rank(cfg, world_size, 0, gpus_per_node)
        ranks = list(range(world_size)) if exhaustive else representatives(layout)
        say(f"meshtrain collective check: tracing {len(ranks)} " +
            ("ranks (every one)" if exhaustive else f"representative ranks of {world_size}: {_short(ranks)}"))
        traces = [first] + [trace_rank(cfg, world_size, rank, gpus_per_node)[0] for rank in ranks[1:]]
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


def _short(values) -> str:
    values = list(values)
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}] ({len(values)})"
