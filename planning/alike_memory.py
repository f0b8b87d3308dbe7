"""The dry run's memory and traffic of a deep stage, exactly, from two shallow traces.

Tracing a step on fake tensors costs about a thousand dispatches per block through
torch's memory tracker: most of a dry run's time is its blocks, 80 of them for a 70B
model. A stretch ("run") of alike blocks (planning/alike_blocks.py) runs the same program
on the same shapes in every block, and what a block holds while it runs depends on the
others only through how many of them there are before and after it: their parameter and
gradient shards, optimizer state and saved activations. So every memory update of the
step is an affine function of the run's length n and, in a middle block, of that block's
index i: M(n, i) = a + b n + c i, each category of the tracker separately.

Two traces give every coefficient: the run cut to 3 blocks (first, one middle, last) and
cut to 4 (a second middle). Each update is tagged with its block (BlockTags.latest); the
second trace less its added block's updates lines up with the first, update for update
(`line_up`; when it does not, the dry run traces every block instead). Then b is an
update's difference between the two traces and, in a middle block, c is the difference
between the second trace's two middle blocks. At the real depth a middle update is
largest at i = 1 or i = n - 2 (it is affine in i), so the peak is the largest of the
extrapolated updates, taken in the order the real step would meet them, as the tracker
does. With several runs on a rank (the stages an interleaved pipeline rank holds), each
run gets its own second trace. Traffic (count and bytes per collective kind) and
parameter counts are affine in n too.

Where an update is not affine in the depth it is not used: selective activation
checkpointing (blocks differ by position), Muon (each rank orthogonalises its share of
the matrices, padded to a multiple of the group), and real tensors. tests/test_dry_run.py
checks the result equals tracing every block, byte for byte, on several layouts.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.planning.alike_blocks import KEEP


class Timeline:
    """Every update of a traced step's memory tracker: the block it belongs to (``tag``)
    and the tracker's categories after it."""

    def __init__(self, tag):
        self.tag, self.tags, self.snaps = tag, [], []

    def record(self, current: dict, tag=None) -> None:
        self.tags.append(self.tag() if tag is None else tag)
        self.snaps.append(dict(next(iter(current.values()), {})))


@dataclasses.dataclass
class Shallow:
    """What one shallow trace gives: its memory timeline, the tracker's categories after
    the step, its traffic rows and its parameter counts."""
    timeline: Timeline
    after: dict
    rows: dict
    counts: dict


def worth_it(real: dict[tuple, int]) -> bool:
    """Tracing 3 blocks of each of R runs, then R times once more with one run at 4,
    beats tracing every block (each trace also builds the rank and runs its head)."""
    r = len(real)
    return r > 0 and (r + 1) * (KEEP * r + 2) + r < sum(real.values())


def stretches(tags: list) -> list[tuple]:
    """(tag, first, end) of each stretch of consecutive updates with the same tag."""
    out = []
    for k, tag in enumerate(tags):
        if out and out[-1][0] == tag:
            out[-1][2] = k + 1
        else:
            out.append([tag, k, k + 1])
    return [tuple(s) for s in out]


def line_up(base: list, grown: list, run: tuple):
    """For each stretch of ``base`` the same stretch of ``grown`` (the trace with one
    middle block more in ``run``), and {base stretch of the run's middle block: the added
    block's stretch in grown}; None when the traces are not the same program with one
    block more. A tag is (phase of the step, block)."""
    middle, added, last = (*run, 1), (*run, KEEP - 1), (*run, KEEP)
    ours, theirs = stretches(base), stretches(grown)
    kept = [k for k, (tag, _, _) in enumerate(theirs) if tag[1] != added]
    relabel = lambda tag: (tag[0], (*run, KEEP - 1)) if tag[1] == last else tag
    if [relabel(theirs[k][0]) for k in kept] != [tag for tag, _, _ in ours]:
        return None
    twins = [k for k, (tag, _, _) in enumerate(theirs) if tag[1] == added]
    firsts = [k for k in kept if theirs[k][0][1] == middle]
    size = lambda s: s[2] - s[1]
    if len(twins) != len(firsts) or any(size(theirs[a]) != size(theirs[b]) for a, b in zip(firsts, twins)):
        return None
    at = dict(enumerate(kept))
    return theirs, at, {e: twins[firsts.index(at[e])] for e, (tag, _, _) in enumerate(ours) if tag[1] == middle}


def extrapolate(base: Shallow, grown: dict[tuple, Shallow], real: dict[tuple, int]):
    """(peak categories, categories after the step, traffic rows, parameter counts) at
    each run's real length ``real``, from the base trace (every run at KEEP blocks) and
    one trace per run with that run at KEEP + 1; None when a pair does not line up.

    A stretch whose number of updates grows with the depth (a loop over the parameters:
    FSDP's lazy init, the gradient norm) is taken whole: its largest update, in each trace."""
    traces = [base, *grown.values()]
    keys = sorted({k for t in traces for s in t.timeline.snaps for k in s})
    total = keys.index("Total")
    matrix = lambda snaps: torch.tensor([[s.get(k, 0) for k in keys] for s in snaps], dtype=torch.int64)
    v = matrix(base.timeline.snaps)
    ours = stretches(base.timeline.tags)
    lined = {}
    for run, g in grown.items():
        lined[run] = line_up(base.timeline.tags, g.timeline.tags, run)
        if lined[run] is None:
            return None
    size = lambda s: s[2] - s[1]
    whole = {e for run, (theirs, at, _) in lined.items() for e, s in enumerate(ours) if size(theirs[at[e]]) != size(s)}
    if any(ours[e][0][1] is not None and ours[e][0][1][2] not in (0, KEEP - 1) for e in whole):
        return None  # a middle block's updates must be the same program in every block

    def updates(m: torch.Tensor, stretch, like=None) -> list[int]:
        """The update indices a stretch stands for: each of them, or its largest."""
        if like in whole:
            return [stretch[1] + int(torch.argmax(m[stretch[1]:stretch[2], total]))]
        return list(range(stretch[1], stretch[2]))

    picked = [k for e, s in enumerate(ours) for k in updates(v, s, e)]
    value, along = v[picked].clone(), torch.zeros(len(picked), len(keys), dtype=torch.int64)
    later_first = torch.zeros(len(picked), dtype=torch.bool)
    for run, g in grown.items():
        theirs, at, twins = lined[run]
        w, extra = matrix(g.timeline.snaps), real[run] - KEEP
        same = [k for e, s in enumerate(ours) for k in updates(w, theirs[at[e]], e)]
        value += extra * (w[same] - v[picked])
        row = 0
        for e, s in enumerate(ours):
            n = len(updates(v, s, e))
            if e in twins:  # block i = n - 2 against block i = 1, update for update
                mine, twin = same[row:row + n], updates(w, theirs[twins[e]], e)
                along[row:row + n] = extra * (w[twin] - w[mine])
                later_first[row:row + n] = twin[0] < mine[0]  # backward: the later block runs first
            row += n
    high = value + along
    # Each middle update at whichever end of the run holds more; on a tie, the end the real
    # step meets first (the tracker keeps the first of equal peaks).
    pick = (high[:, total] > value[:, total]) | ((high[:, total] == value[:, total]) & later_first)
    final = torch.where(pick[:, None], high, value)
    peak = dict(zip(keys, final[int(torch.argmax(final[:, total]))].tolist()))
    return (peak, _linear(base.after, {r: g.after for r, g in grown.items()}, real),
            _rows(base.rows, {r: g.rows for r, g in grown.items()}, real),
            _linear(base.counts, {r: g.counts for r, g in grown.items()}, real))


def _linear(base: dict, grown: dict[tuple, dict], real: dict[tuple, int]) -> dict:
    keys = set(base).union(*grown.values())
    return {k: base.get(k, 0) + sum((real[r] - KEEP) * (g.get(k, 0) - base.get(k, 0)) for r, g in grown.items())
            for k in keys}


def _rows(base: dict, grown: dict[tuple, dict], real: dict[tuple, int]) -> dict:
    """Traffic rows, (count, payload, sent) per (dimension, kind), each affine in the depth."""
    keys = set(base).union(*grown.values())
    zero = (0, 0, 0)
    return {k: tuple(b + sum((real[r] - KEEP) * (g.get(k, zero)[i] - b) for r, g in grown.items())
                     for i, b in enumerate(base.get(k, zero))) for k in keys}
