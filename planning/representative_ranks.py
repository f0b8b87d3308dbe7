"""Which ranks the collective check traces, and which traced rank each other rank is
derived from.

The programs of a layout fall into few roles: under a pipeline each pp coordinate runs
different layers; in the other dimensions the ranks run the same program on different
data. So one rank per pp coordinate is traced, plus one per dimension of size > 1 at the
last coordinate of that dimension (where uneven shards would show) and the world's last
rank. Every other rank issues, in each of its groups, what the traced rank of its pp
coordinate issues in that rank's group of the same dimension.
"""

from __future__ import annotations

import torch

from meshtrain.parallel.vocabulary import DIM_NAMES


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
