"""What each pipeline rank of a layout holds and runs: its stages' layers, whether it has
the embedding or the head, how many micro-batches of activations are alive at its peak,
and how many of its blocks activation checkpointing wraps. The memory and time models
(memory.py, step_time.py) both start from these shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.parallel.layout import ParallelDims
from meshtrain.parallel.pipeline import check_pipeline, stage_ids
from meshtrain.parallel.vocabulary import WHOLE_BACKWARD
from meshtrain.planning.schedule import in_flight_at_peak, replayed_actions
from meshtrain.planning.shape import Job, rank_batch


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank (all of its dp x tp GPUs alike) holds and runs."""
    stage_layers: tuple[int, ...]   # layers in each of its stages
    first: bool                     # holds the embedding
    last: bool                      # holds the final norm and output
    inflight: float                 # (layer, micro-batch) activation sets alive at its peak
    head_inflight: int              # micro-batches whose loss is kept for backward (last stage)
    stage_ids: tuple[int, ...] = (0,)   # its stages' global indices, in stage_layers' order
    n_stages: int = 1                   # stages of the whole pipeline
    stage_moe: tuple[int, ...] = (0,)   # of each stage's layers, the MoE blocks (the model's last ones)

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def moe_layers(self) -> int:
        return sum(self.stage_moe)


def rank_shares(job: Job, lay: ParallelDims) -> list[RankShare]:
    """Per pipeline rank: its layers and how many micro-batches of activations it holds at
    its peak. Stages come from parallel.pipeline (the same split and placement train.py
    uses), so an invalid pipeline raises the same LayoutError."""
    L, pp, m, v = job.model.n_layers, lay.pp, lay.pp_microbatches, lay.stages_per_rank
    first_moe = L - job.model.moe_layers  # MoE blocks follow the dense ones (models/moe: n_dense_layers)
    if pp == 1:
        return [RankShare((L,), True, True, inflight=L, head_inflight=1, stage_moe=(job.model.moe_layers,))]
    stages = check_pipeline(pp=pp, n_layers=L, schedule=lay.pp_schedule, stages_per_rank=v,
                            n_microbatches=m, local_batch=rank_batch(job, lay))
    style = lay.placement
    shares = []
    for r in range(pp):
        ids = stage_ids(r, pp, len(stages), style)
        sizes = tuple(len(stages[s]) for s in ids)
        if lay.pp_schedule not in WHOLE_BACKWARD or style != "loop":
            raise ValueError(f"no activation-memory model for pp_schedule {lay.pp_schedule!r}")
        # Counted from torch's own order of this rank's forwards and backwards (the one the
        # dry run replays, planning/schedule.py), not a closed form: layers x micro-batches
        # alive at the rank's worst backward, and the last stage's micro-batches then.
        actions = replayed_actions(lay.pp_schedule, pp, v, m, r)  # the states of the whole list, once each
        inflight, live, _ = in_flight_at_peak(actions, {s: len(stages[s]) for s in ids})
        head = max(1, live.get(len(stages) - 1, 0))
        moe = tuple(sum(layer >= first_moe for layer in stages[s]) for s in ids)
        shares.append(RankShare(sizes, 0 in ids, len(stages) - 1 in ids, inflight, head, tuple(ids), len(stages),
                                moe))
    return shares


def checkpointed_moe_blocks(share: RankShare, ac: str) -> int:
    """Of `checkpointed_blocks`, the MoE ones (each stage's last stage_moe blocks)."""
    if ac == "full":
        return share.moe_layers
    if ac == "selective":
        return sum(sum(j % 2 == 0 for j in range(n - k, n)) for n, k in zip(share.stage_layers, share.stage_moe))
    return 0


def checkpointed_blocks(share: RankShare, ac: str) -> int:
    """Blocks apply_ac wraps on this rank: all (full), every 2nd of each stage counting
    from its first (selective, selective_every = 2), none."""
    if ac == "full":
        return share.layers
    if ac == "selective":
        return sum(math.ceil(n / 2) for n in share.stage_layers)
    return 0
