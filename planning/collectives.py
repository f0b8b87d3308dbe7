"""Every collective a traced step dispatches, filed under the mesh dimension of its group:
count, payload and the bytes one rank sends. The dry run reports them; the collective
check (planning/collective_check.py) records them in order instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


_COLLECTIVES = {  # op name -> (kind, which tensor's size is the payload)
    "_allgather_base_": ("all-gather", "out"), "allgather_into_tensor_coalesced_": ("all-gather", "out"),
    "all_gather_into_tensor": ("all-gather", "out"), "_reduce_scatter_base_": ("reduce-scatter", "in"),
    "reduce_scatter_tensor": ("reduce-scatter", "in"), "reduce_scatter_tensor_coalesced_": ("reduce-scatter", "in"),
    "allreduce_": ("all-reduce", "in"), "all_reduce": ("all-reduce", "in"),
    "broadcast_": ("broadcast", "in"), "send": ("send/recv", "in"), "recv_": ("send/recv", "in"),
    "alltoall_base_": ("all-to-all", "in"), "all_to_all_single": ("all-to-all", "in"),
}


@dataclass
class CommStats:
    """Collectives by (mesh dimension, kind): count, payload bytes, and the bytes one rank
    sends with ring algorithms: all-gather / reduce-scatter (n-1)/n of the full tensor,
    all-reduce twice that; an all-to-all keeps 1/n of its input and sends the rest."""
    rows: dict = field(default_factory=dict)
    log: list | None = None  # a list: every add's arguments (planning/alike_microbatches.py)

    def add(self, dim: str, kind: str, payload: int, n: int, times: float = 1) -> None:
        if self.log is not None:
            self.log.append((dim, kind, payload, n, times))
        factor = {"all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-to-all": (n - 1) / n,
                  "all-reduce": 2 * (n - 1) / n}.get(kind, 1.0)
        count, total, sent = self.rows.get((dim, kind), (0, 0, 0.0))
        self.rows[(dim, kind)] = (count + times, total + payload * times, sent + payload * factor * times)


class CountCollectives(TorchDispatchMode):
    """Sees every c10d / functional collective as it is dispatched (the fake group makes
    them no-ops) and files it under the mesh dimension its group belongs to."""

    def __init__(self, group_names: dict[str, tuple[str, int]]):
        super().__init__()
        self.group_names, self.stats, self.phase = group_names, CommStats(), ""
        self.stage_io = {}  # pipeline stage -> ((input shape, dtype), (output shape, dtype))
        # (dimension, kind) -> how many times the step repeats what is being traced now
        self.scale = lambda dim, kind: 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A DTensor op goes back to DTensor first (as torch's memory tracker does): the
        # collectives its dispatch issues (loss_parallel's all-reduces, a redistribution
        # its sharding rule asks for) then come here as local ops. Run inside this
        # handler instead, they would pass below this mode, uncounted.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        self.see(func, args)
        return func(*args, **(kwargs or {}))

    def see(self, func, args) -> None:
        """One dispatched op: filed if it is a collective. The dry run calls this from its
        memory tracker's dispatch (planning/fake_world.py) instead of entering this mode."""
        name = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name in _COLLECTIVES:
            kind, which = _COLLECTIVES[name]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            tensor = tensors[0] if which == "out" or len(tensors) == 1 else tensors[-1]
            if name in ("allreduce_", "broadcast_"):
                tensor = tensors[0]
            # The functional all-gather (TP's, through DTensor) takes only this rank's shard
            # and returns the gathered tensor: the payload is the shard x the group's size.
            gathered = args[1] if func.namespace == "_c10d_functional" and name == "all_gather_into_tensor" else 1
            self.on_collective(kind, tensor, args, gathered)

    def on_collective(self, kind: str, payload: torch.Tensor, args, gathered: int = 1) -> None:
        """``payload``: the tensor the collective is recorded by; ``gathered``: how many of it
        the full payload is (a functional all-gather's shard: the group's size)."""
        dim, n = self._group(args)
        self.stats.add(dim, kind, payload.numel() * payload.element_size() * gathered, n, self.scale(dim, kind))

    def _group(self, args) -> tuple[str, int]:
        for a in args:
            if isinstance(a, str) and a in self.group_names:
                return self.group_names[a]
            if type(a).__name__ == "ScriptObject":
                try:
                    pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
                except Exception:
                    continue
                return self.group_names.get(pg.group_name, (f"group of {pg.size()}", pg.size()))
        return "?", 1


def mesh_group_names(mesh) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dimension(s), size), for the groups this rank is in."""
    names = {}
    dims = mesh.mesh_dim_names or ()
    for dim in dims:
        names[mesh[dim].get_group().group_name] = (dim, mesh[dim].size())
    for i in range(len(dims)):  # flattened groups (dp, clipping's whole-mesh groups)
        for j in range(i + 2, len(dims) + 1):
            sub = mesh[dims[i:j]]
            try:
                flat = sub._flatten()
            except Exception:
                continue
            names.setdefault(flat.get_group().group_name, ("x".join(dims[i:j]), flat.size()))
    from meshtrain.parallel.expert_parallel import EXPERT_DIMS, made_expert_mesh

    experts = made_expert_mesh(mesh)  # expert parallelism: its all-to-alls, the experts' FSDP
    for dim in EXPERT_DIMS if experts is not None else ():
        names.setdefault(experts[dim].get_group().group_name, (dim, experts[dim].size()))
    return names
