"""What a pipeline rank runs, in order: torch's own description of its schedules.

    rank_actions("Interleaved1F1B", pp=8, stages_per_rank=2, n_microbatches=32)
        -> {0: [Action("F", 0, 0), Action("F", 0, 1), ..., Action("B", 8, 0), ...], 1: [...], ...}

`torch.distributed.pipelining` builds every schedule from an intermediate representation:
per pp rank, the list of forwards ("F"), backwards ("B") and idle slots its runtime
executes (`pipeline_order`; `_get_pipeline_order` for the one-stage schedules). It is
computed from (pp, stages per rank, micro-batches) alone, so it is read here without a
process group or stages, by calling torch's own methods on a bare schedule object. The
dry run replays one rank's list to trace its memory, the estimate counts the micro-batches
in flight from it, and the step-time model simulates all ranks' lists to get the bubble.
These are private torch methods: the test suite pins what they return for every schedule
the planner uses, so a torch upgrade that changes them fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshtrain.parallel.vocabulary import WHOLE_BACKWARD


@dataclass(frozen=True)
class Action:
    kind: str        # "F" forward or "B" backward (input and weight gradients together)
    stage: int       # global stage index
    microbatch: int


@lru_cache(maxsize=256)
def _rank_actions(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int) -> tuple:
    from torch.distributed.pipelining import schedules as S

    if schedule not in WHOLE_BACKWARD:
        raise NotImplementedError(f"no F/B action model for pp_schedule {schedule!r}; the planner and "
                                  f"dry run handle {', '.join(WHOLE_BACKWARD)}")
    cls = S.get_schedule_class(schedule)
    bare = cls.__new__(cls)  # no stages, no process group: only the fields the IR is computed from
    bare._n_microbatches = n_microbatches
    if issubclass(cls, S.PipelineScheduleSingle):
        bare._num_stages = pp
        order = bare._get_pipeline_order()
    else:
        bare.pp_group_size, bare.n_local_stages = pp, stages_per_rank
        bare.number_of_rounds = max(1, n_microbatches // pp)        # as the constructor sets them
        bare.microbatches_per_round = n_microbatches // bare.number_of_rounds
        bare._stages = [None] * stages_per_rank
        order = {rank: bare._calculate_single_rank_operations(rank) for rank in range(pp)}
    kinds = {S.FORWARD: "F", S.FULL_BACKWARD: "B"}
    return tuple(_consistent([Action(kinds[a.computation_type], a.stage_index, a.microbatch_index or 0)
                              for a in order[rank] if a is not None and a.computation_type in kinds])
                 for rank in range(pp))


def _consistent(actions: list[Action]) -> tuple[Action, ...]:
    """torch's description of 1F1B numbers the last rank's forwards from 1 and its
    backwards from 0 (what runs is right; only the description is off by one). Where a
    stage's forward and backward numbers differ, number both in order of appearance."""
    for stage in {a.stage for a in actions}:
        fwd = [a.microbatch for a in actions if a.stage == stage and a.kind == "F"]
        bwd = [a.microbatch for a in actions if a.stage == stage and a.kind == "B"]
        if sorted(fwd) != sorted(bwd):
            seen = {"F": 0, "B": 0}
            renumbered = []
            for a in actions:
                if a.stage == stage:
                    a = Action(a.kind, stage, seen[a.kind])
                    seen[a.kind] += 1
                renumbered.append(a)
            actions = renumbered
    return tuple(actions)


def rank_actions(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int) -> list[list[Action]]:
    """Per pp rank, the forwards and backwards it runs in one step, in order."""
    return [list(a) for a in _rank_actions(schedule, pp, stages_per_rank, n_microbatches)]


@lru_cache(maxsize=4096)
def replayed_actions(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int,
                     rank: int) -> tuple[Action, ...]:
    """One pp rank's list as `replay_prefix` shortens it, kept once per layout: what the
    memory estimate walks to find a rank's worst backward. The search asks it of thousands
    of layouts; walking each whole list (2 x stages x micro-batches actions, for every rank)
    was most of `meshtrain plan`'s time."""
    return tuple(replay_prefix(list(_rank_actions(schedule, pp, stages_per_rank, n_microbatches)[rank])))


def replay_prefix(actions: list[Action]) -> list[Action]:
    """The part of one rank's list a memory trace must run to meet every state of its step:
    its warm-up and steady state up to the last new state, then its cool-down.

    The memory at a backward is set by the micro-batches in flight per stage, by which
    stages have had their first backward (from then on a stage's gradients accumulate
    unsharded until the step's end) and by which stages ran a backward since their last
    forward (FULL_SHARD reshards after each forward, so a stage is gathered from its
    backward to its next forward; in the cool-down, with no forwards left, every stage
    stays gathered). In the steady state the same states come round again and again. So
    the list is run until it reaches, after its last new state, the state it is in at its
    last forward; then its cool-down, the real one's backwards stage by stage, on the
    micro-batches in flight. A 256-micro-batch list shrinks to its warm-up, about one
    round and its cool-down."""
    last_forward = max(i for i, a in enumerate(actions) if a.kind == "F")
    live: dict[int, int] = {}
    begun, gathered = set(), set()
    states, seen, newest = [], set(), 0
    for i, a in enumerate(actions[:last_forward + 1]):
        live[a.stage] = live.get(a.stage, 0) + (1 if a.kind == "F" else -1)
        if a.kind == "B":
            begun.add(a.stage)
            gathered.add(a.stage)
        else:
            gathered.discard(a.stage)
        state = (a.kind, a.stage, tuple(sorted(live.items())), frozenset(begun), frozenset(gathered))
        states.append(state)
        if state not in seen:
            seen.add(state)
            newest = i
    cut = next(i for i in range(newest, last_forward + 1) if states[i] == states[last_forward]) + 1
    prefix = actions[:cut]
    done = {(a.stage, a.microbatch) for a in prefix if a.kind == "B"}
    pending: dict[int, list[int]] = {}
    for a in prefix:
        if a.kind == "F" and (a.stage, a.microbatch) not in done:
            pending.setdefault(a.stage, []).append(a.microbatch)
    cooldown = [Action("B", a.stage, pending[a.stage].pop(0)) for a in actions[last_forward + 1:]
                if pending.get(a.stage)]
    rest = [Action("B", s, mb) for s, mbs in pending.items() for mb in reversed(mbs)]
    return prefix + cooldown + rest


def in_flight_at_peak(actions: list[Action], weight: dict[int, float],
                      working: dict[int, float] | None = None) -> tuple[float, dict[int, int], int]:
    """(bytes, micro-batches in flight per stage, the stage running a backward) at the
    worst moment of a rank's list: during a backward, weight[s] bytes kept per in-flight
    micro-batch of stage s, plus working[s] while stage s runs its backward."""
    working = working or {}
    live: dict[int, int] = {s: 0 for s in weight}
    best = (-1.0, {}, -1)
    for a in actions:
        if a.kind == "F":
            live[a.stage] += 1
            continue
        held = sum(live[s] * weight[s] for s in live) + working.get(a.stage, 0.0)
        if held > best[0]:
            best = (held, dict(live), a.stage)
        live[a.stage] -= 1
    return best


class Deadlock(RuntimeError):
    """The ranks' lists wait on each other; ``waiting`` holds (pp rank, its next action)."""

    def __init__(self, waiting: list[tuple[int, Action]]):
        super().__init__(f"the ranks' lists wait on each other: {waiting}")
        self.waiting = waiting


def play(lists: list[list[Action]], n_stages: int, forward=1.0, backward=2.0, hop: float = 0.0) -> float:
    """Run every pp rank's list against the others: an action starts when its rank is free
    and its input is there (the previous stage's forward of that micro-batch; the next
    stage's backward, or its own forward on the last stage). ``forward`` / ``backward``:
    the seconds of one micro-batch through a stage, one number for every stage or a
    sequence indexed by stage (the first stage also runs the embedding, the last the output
    layer and loss). ``hop``: the seconds an activation (or its gradient) takes from one
    rank to the next -- latency plus bytes over the link --, a delay between the producing
    action's end and the consuming one's earliest start (none between stages of one rank).
    Returns when the last rank finishes; raises `Deadlock`."""
    pp = len(lists)
    per_stage = lambda x: x if isinstance(x, (list, tuple)) else [x] * n_stages
    forward, backward = per_stage(forward), per_stage(backward)
    rank_of = {a.stage: r for r, actions in enumerate(lists) for a in actions}
    done: dict[tuple, float] = {}
    free, pos = [0.0] * pp, [0] * pp
    while any(p < len(lst) for p, lst in zip(pos, lists)):
        moved = False
        for r, actions in enumerate(lists):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if a.kind == "F":
                    need = ("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
                else:
                    need = ("B", a.stage + 1, a.microbatch) if a.stage < n_stages - 1 else ("F", a.stage, a.microbatch)
                if need is not None and need not in done:
                    break
                arrives = done[need] + (hop if rank_of[need[1]] != r else 0.0) if need else 0.0
                start = max(free[r], arrives)
                free[r] = start + (forward[a.stage] if a.kind == "F" else backward[a.stage])
                done[(a.kind, a.stage, a.microbatch)] = free[r]
                pos[r], moved = pos[r] + 1, True
        if not moved:
            raise Deadlock([(r, lists[r][pos[r]]) for r in range(pp) if pos[r] < len(lists[r])])
    return max(free)


def makespan(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int,
             forward, backward, hop: float = 0.0) -> float:
    """The time torch's schedule takes when a forward of stage s takes ``forward`` (or
    ``forward[s]``), a backward ``backward`` (``backward[s]``), and every send between two
    ranks ``hop`` (`play` over its lists). The step's idle time -- the bubble -- is what
    this adds to one rank's busy time."""
    return play(rank_actions(schedule, pp, stages_per_rank, n_microbatches), pp * stages_per_rank,
                forward, backward, hop)
