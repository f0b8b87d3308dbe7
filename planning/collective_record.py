"""What the collective check records of a traced rank: each collective in order, per
process group, with the phase of the step that issued it, and every group of the
dimension that group was made for (torch's own list, kept by the fake world)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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
    """CountCollectives that also keeps, per process group, the ordered list of calls, and
    beside each the tag ``tag()`` gives it (planning/alike_blocks.py: the block it is for)."""

    def __init__(self, group_names, trace: RankTrace, tag=lambda: None):
        super().__init__(group_names)
        self.trace, self.members, self.partition_of = trace, {}, {}
        self.tag, self.tags = tag, {}  # group members -> the tag of each call

    def on_collective(self, kind: str, payload: torch.Tensor, args, gathered: int = 1) -> None:
        members = self._members(args)
        label = self.trace.labels.setdefault(members, self._group(args)[0])
        if label not in self.trace.partitions:
            self.trace.partitions[label] = self.partition_of[members]
        self.trace.calls.setdefault(members, []).append(
            Call(kind, tuple(payload.shape), str(payload.dtype).replace("torch.", ""), self.phase))
        self.tags.setdefault(members, []).append(self.tag())
        super().on_collective(kind, payload, args, gathered)

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
