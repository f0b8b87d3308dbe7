"""A pipeline rank's stages traced at once: some in a forked process, the others here.

An interleaved pipeline rank holds two or more stages (llama405b_3d at 512 ranks: 2 of
16, 7 and 8 blocks), and its replay (planning/traced_step.py `_trace_pipeline`) runs
their forwards and backwards in the one order torch's schedule gives them: a 405B rank's
dry run was that replay, one core busy and the other idle. What one stage's action does
to the tracker's memory (each update, and what it leaves) and which collectives it
issues do not depend on the other stages' actions: each stage is a module of its own,
with its own FSDP units, parameters, inputs, activations and gradients, and the tracker
sums the memory of all of them. That is the premise the micro-batch copies of
planning/alike_microbatches.py stand on too: a `Record` of an action, played from
wherever memory stands, does what tracing it there would do.

So each process traces only its own stages' actions in the schedule's order (the
micro-batches traced there, and each stage's gradient reduction), recording each as a
`Record`; the forked process sends its records back. Then this process plays every
action of the step in the schedule's order, from the memory the replay began with: a
traced action its own record, a copied micro-batch its template's (`Copier.copy`). The
peak, the memory left after the step and the collectives (counted in the step's order,
so their sums are the same floats) are what the whole replay gives. One exception: the
gradient clipping after the step skips the other process's gradients, which do not
exist here; its norms of them (a few bytes each, after the step's peak: the reduction
before it has freed the unsharded gradients) are not traced, and every mesh its
collectives use holds a gradient of this process's stages (`worth_splitting`).

Not split where that premise fails in the tracker: with frozen weights (LoRA's base)
torch's module hooks keep gradients in reference cycles, freed whenever Python's
collector runs, at other moments in each process (`worth_splitting`).

`tests/test_stages_apart.py` checks the reports are the same, byte for byte, as one
process tracing every micro-batch (Interleaved1F1B, first rank and last rank with
accumulation; LoopedBFS with TP), and that they differ when the forked records' net
changes are dropped.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from meshtrain.planning import forked
from meshtrain.planning.alike_microbatches import Record, first_highest
from meshtrain.planning.collectives import CommStats


def _meshes(parts) -> set:
    return {q.device_mesh if isinstance(q, DTensor) else None for _, part in parts
            for q in part.parameters() if q.requires_grad}


def away_stages(traced_forwards: dict[int, int], layout) -> list[int]:
    """The stages a forked process traces: about half of the traced blocks' work (each
    stage's traced forwards times its layers), the rest staying here."""
    work = {s: n * max(1, len(layout.stage_layers[s])) for s, n in traced_forwards.items()}
    here, away = [], []
    for s in sorted(work, key=work.get, reverse=True):
        lighter = here if sum(work[t] for t in here) <= sum(work[t] for t in away) else away
        lighter.append(s)
    return away


def worth_splitting(parts, tracker) -> bool:
    """Whether to trace this rank's stages apart: several stages, every weight trained,
    a second core to fork onto, one device's memory followed (a record plays its highest
    update only), no timeline of every update (planning/alike_memory.py), and clipping's
    meshes all held here whichever stages go (a stage's norms are all-reduced per mesh). The caller also
    makes sure no optimizer step is traced after the replay: it would miss the other
    process's gradients."""
    if len(parts) < 2 or tracker is None or tracker.timeline is not None:
        return False
    if any(not q.requires_grad for _, part in parts for q in part.parameters()):
        # Frozen weights (LoRA's base): the tracker's module hooks keep gradients in
        # reference cycles (torch's register_multi_grad_hook buffers them for inputs
        # whose companions never get one), freed whenever Python's collector runs, and
        # it runs at other moments in each process.
        return False
    if len(tracker._curr_mem_snap) != 1 or forked.default_jobs() < 2:
        return False
    every = _meshes(parts)
    return all(_meshes([p]) == every for p in parts)


def _highest_only(record: Record) -> Record:
    """What playing the record needs for the peak: its first highest update (as
    `Copier.copy` plays it), its net change and its collectives."""
    updates = [record.updates[first_highest(record.updates)]] if record.updates else []
    return Record(updates, None, record.net, record.collectives)


def trace_apart(actions, copied, parts, away, copier, setup, run, reduce) -> None:
    """Replay ``actions`` (``copied``: micro-batch -> the one it repeats) with the stages
    in ``away`` traced in a forked process. ``setup(a)`` sets the counter's scale and phase
    for action ``a``, ``run(a)`` runs it, ``reduce(stage, part)`` reduces a stage's
    gradients after the step's last backward."""
    tracker, comm = copier.tracker, copier.comm
    start = copier._now()
    peak = dict(tracker._peak_mem), {dev: dict(snap) for dev, snap in tracker._peak_mem_snap.items()}

    def trace(stages) -> None:
        for a in actions:
            key = (a.stage, a.microbatch)
            if a.stage in stages and key not in copied:
                setup(a)
                with copier.traced(a.kind, key, keep=True):
                    run(a)
        for s, part in parts:
            if s in stages:
                with copier.traced("R", (s, None), keep=True):
                    reduce(s, part)

    def traced_away() -> tuple[dict, dict]:
        """In the forked process: its records, cut to what the peak needs, and its stages'
        input and output shapes."""
        trace(set(away))
        return ({k: _highest_only(r) for k, r in copier.records.items()},
                {s: io for s, io in comm.stage_io.items() if s in away})

    counted, comm.stats = comm.stats, CommStats()  # counted below, in the step's order
    with forked.later(traced_away) as theirs:
        trace({s for s, _ in parts} - set(away))
        records, stage_io = theirs()
    comm.stats = counted
    copier.records.update(records)
    comm.stage_io.update(stage_io)

    # The whole step, played from where the replay began.
    tracker._peak_mem, tracker._peak_mem_snap = peak
    tracker._curr_mem_snap.clear()
    tracker._curr_mem_snap.update(start)
    for a in actions:
        key = (a.stage, a.microbatch)
        setup(a)
        copier.copy(a.kind, copied.get(key, key), comm.phase)
    for s, _ in parts:
        copier.copy("R", (s, None), "gradient reduction")
