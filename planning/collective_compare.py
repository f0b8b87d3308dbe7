"""The collective check's three comparisons of the traced ranks: every group's members
issue the same sequence, each pipeline stage sends what the next is built to receive, and
the schedule plays out over all pp ranks without a receive that never meets its send."""

from __future__ import annotations

import torch

from meshtrain.parallel.vocabulary import WHOLE_BACKWARD
from meshtrain.planning.collective_record import RankTrace


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


def _short(values) -> str:
    values = list(values)
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}] ({len(values)})"
