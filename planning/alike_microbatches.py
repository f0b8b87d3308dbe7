"""The dry run's pipeline replay with each kind of micro-batch traced once.

A pipeline rank's replay (planning/schedule.py `replay_prefix`) runs every forward its
schedule keeps in flight: Interleaved1F1B at pp 8 holds 24 micro-batches of each of a
rank's two stages, and tracing them was most of a 405B dry run's time. What one forward
or backward does to memory and traffic is set by its stage and by that stage's own
history, not by which micro-batch it carries: whether the stage has had its first
backward (from then on its unsharded gradients exist and accumulate) and what the stage
ran last (a backward leaves it gathered; a forward, under FULL_SHARD, resharded). Those
are the states `replay_prefix` follows too. What a stage ran last matters only where a
forward frees the weights it gathered (FULL_SHARD); a stage that keeps them gathered
(SHARD_GRAD_OP, a pipeline stage's default) is in the same state after either, and of its
forwards only the first few differ: 4 of each stage's 24 are traced on llama405b_3d's rank 0.

So a micro-batch whose forward and backward meet the same histories as an earlier traced
micro-batch of its stage does what that one did: its forward moves every category of the
tracker's memory through the same updates from where it starts, its backward frees the
same bytes again, and both dispatch the same collectives. It is not traced (`copies`):
the tracker's memory takes the recorded updates of the traced one, each of them (for the
peak, and for planning/alike_memory.py's timeline), and its collectives are counted again
(`Copier`). The micro-batches that are traced keep, among themselves, every action's
history as it is in the whole list, so each traced action runs what it would run in the
whole step. tests/test_alike_microbatches.py checks the report equals tracing every
micro-batch, byte for byte, on every schedule the dry run replays.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


def histories(actions, keep_gathered=frozenset()) -> list[tuple]:
    """Per action: (kind, stage, whether the stage ran a backward before, the kind of the
    stage's previous action or None, how many of this kind the stage ran before: 0, 1 or
    more). The count: a stage's first forward gathers it, and its second meets what the
    first left (the memory tracker files the gathered weights under parameters then).
    The previous action matters only to a stage that frees its gathered parameters after a
    forward (FULL_SHARD): one in ``keep_gathered`` (SHARD_GRAD_OP, ZeRO-2: a pipeline
    stage's default; no FSDP) is gathered after a forward as after a backward (the schedule
    does not reshard after a backward either), so for it the previous kind is left None."""
    last, begun, ran, out = {}, set(), {}, []
    for a in actions:
        before = None if a.stage in keep_gathered else last.get(a.stage)
        out.append((a.kind, a.stage, a.stage in begun, before, min(ran.get((a.kind, a.stage), 0), 2)))
        last[a.stage] = a.kind
        ran[a.kind, a.stage] = ran.get((a.kind, a.stage), 0) + 1
        if a.kind == "B":
            begun.add(a.stage)
    return out


def copies(actions, keep_gathered=frozenset()) -> dict[tuple[int, int], tuple[int, int]]:
    """{(stage, micro-batch) not traced: the traced (stage, micro-batch) it repeats}. A
    micro-batch repeats an earlier traced one of its stage whose forward and backward have
    the same histories and come before its own. Every action still traced must keep its
    history: in a steady state of alternating forwards and backwards, leaving one
    micro-batch out leaves two forwards side by side, so the micro-batch whose forward
    follows the left-out backward is left out with it, and so on down the chain.
    ``keep_gathered``: the stages that do not reshard after a forward (`histories`); theirs
    need no such chain, and a few forwards of each are traced however many there are
    (at most four on llama405b_3d's ranks)."""
    where = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
    whole = histories(actions, keep_gathered)
    pair = lambda key: (whole[where["F", *key]], whole[where["B", *key]])
    order = [(a.stage, a.microbatch) for a in actions if a.kind == "F" and ("B", a.stage, a.microbatch) in where]
    out: dict = {}

    def like(key, trial):
        return next((t for t in order if t[0] == key[0] and t != key and t not in out and t not in trial
                     and pair(t) == pair(key) and where["F", *t] < where["F", *key]
                     and where["B", *t] < where["B", *key]), None)

    for first in order:
        trial, key = {}, first
        # a micro-batch already left out, or traced for another to repeat, ends the chain
        while key not in out and key not in trial and key not in {*out.values(), *trial.values()}:
            trial[key] = like(key, trial)
            if trial[key] is None:
                break
            kept = [i for i, a in enumerate(actions) if (a.stage, a.microbatch) not in out | trial.keys()]
            broken = next((i for i, h in zip(kept, histories([actions[i] for i in kept], keep_gathered))
                           if h != whole[i]), None)
            if broken is None:
                out.update(trial)
                break
            key = (actions[broken].stage, actions[broken].microbatch)
    return out


def keep_gathered(parts) -> frozenset[int]:
    """The stages of ``parts`` ((stage, module), ...) none of whose FSDP units frees its
    gathered parameters after a forward (`histories`)."""
    from torch.distributed.fsdp import FSDPModule

    def reshards(unit) -> bool:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        return any(g is not None and g._reshard_after_forward for g in groups)

    return frozenset(s for s, part in parts
                     if not any(reshards(m) for m in part.modules() if isinstance(m, FSDPModule)))


@dataclass
class Record:
    """What one traced action did: the tracker's memory at each update, less its memory
    when the action began (per device, per category); the timeline's tags (or None); its
    change over the whole action; the collectives it counted, as `CommStats.add` got them."""
    updates: list
    tags: list | None
    net: dict
    collectives: list


def _less(snap: dict, base: dict) -> dict:
    return {dev: {k: v - base.get(dev, {}).get(k, 0) for k, v in cats.items()} for dev, cats in snap.items()}


def _plus(base: dict, delta: dict) -> dict:
    out = {dev: dict(cats) for dev, cats in base.items()}
    for dev, cats in delta.items():
        mine = out.setdefault(dev, {})
        for k, v in cats.items():
            mine[k] = mine.get(k, 0) + v
    return out


def first_highest(updates: list) -> int:
    """Of one device's updates, the index of the first with the highest total: the one
    update of them that can set a peak."""
    return max(range(len(updates)), key=lambda i: next(iter(updates[i].values()))["Total"])


class Copier:
    """Records traced actions (`traced`) and plays their records for the copies (`copy`)
    on the memory tracker (planning/fake_world.py `peak_only`) and the collective counter."""

    def __init__(self, tracker, comm):
        self.tracker, self.comm, self.records = tracker, comm, {}

    def _now(self) -> dict:
        return {dev: dict(cats) for dev, cats in self.tracker._curr_mem_snap.items()}

    @contextmanager
    def traced(self, kind: str, key: tuple[int, int], keep: bool):
        if not keep:
            yield
            return
        t, start = self.tracker, self._now()
        mark = len(t.timeline.tags) if t.timeline is not None else None
        t.recording, self.comm.stats.log = [], []
        try:
            yield
        finally:
            updates, collectives = t.recording, self.comm.stats.log
            t.recording = self.comm.stats.log = None
        self.records[kind, key] = Record([_less(u, start) for u in updates],
                                         t.timeline.tags[mark:] if mark is not None else None,
                                         _less(self._now(), start), collectives)

    def copy(self, kind: str, like: tuple[int, int], phase: str) -> None:
        """Play the record of ``like``'s action of ``kind`` from the memory there is now;
        ``phase``: the copy's name in the timeline's tags."""
        t, record = self.tracker, self.records[kind, like]
        start, updates = self._now(), list(enumerate(record.updates))
        if t.timeline is None and t.recording is None and len(start) == 1 and updates:
            # Only the peak reads these updates, and of a record's only its first highest
            # can raise it (`note` keeps the first of equal totals).
            updates = [updates[first_highest(record.updates)]]
        for k, delta in updates:
            t.note(_plus(start, delta), (phase, record.tags[k][1]) if record.tags is not None else None)
        t._curr_mem_snap.clear()
        t._curr_mem_snap.update(_plus(start, record.net))
        for args in record.collectives:
            self.comm.stats.add(*args)
