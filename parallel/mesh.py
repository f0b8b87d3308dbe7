"""One DeviceMesh for every parallelism: pp x dp_replicate x dp_shard x cp x tp, and the
process group under it. (`ParallelDims`, parallel/layout.py, holds the degrees and builds it.)

The order matters. Ranks are numbered so that the *last* mesh dimension varies
fastest, so with tp last, a TP group is `tp` consecutive ranks. torchrun numbers
ranks node by node, so a TP group lands inside one node and its per-layer
all-reduces / all-gathers ride NVLink. FSDP (dp_shard) groups stride across
nodes: they communicate once per FSDP unit per step, which tolerates the slower
inter-node network. dp_replicate (HSDP replicas) and pp are further out still.

Example, 16 ranks = 2 nodes x 8 GPUs, ParallelDims(dp_replicate=2, dp_shard=2, tp=4):

    node 0: ranks 0-7          node 1: ranks 8-15
    tp groups:       [0 1 2 3] [4 5 6 7] [8 9 10 11] [12 13 14 15]
    dp_shard groups: [0 4] [1 5] [2 6] [3 7] [8 12] ...   (inside a node here)
    dp_replicate:    [0 8] [1 9] ...                      (across nodes)

Context parallelism (cp) sits next to tp: its ranks hold the same weights and split the
sequence, and its all-to-alls (two per attention layer) want the fast links too. FSDP
shards over dp_shard x cp (one flattened dimension): the cp ranks' gradients are summed
like any data-parallel ranks', while the batch is split over dp_replicate x dp_shard only.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain.parallel.vocabulary import DIM_NAMES

# Sub-meshes made of several dimensions: "dp" (the batch is split over it), "dp_shard_cp"
# (FSDP shards over it), "dp_cp" (every rank holding the same weights under NO_SHARD).
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


class LayoutError(ValueError):
    """A parallel layout that cannot run: the message lists every problem found."""


def build_device_mesh(degrees: dict[str, int], world_size: int, device_type: str | None = None,
                      timeout_seconds: float | None = None) -> DeviceMesh:
    """Initialize the process group if needed and build the mesh of ``degrees`` (a
    ParallelDims' own: `ParallelDims.build_mesh` is the way in).

    Only dimensions of degree > 1 become mesh dimensions: a degree-1 dimension
    would still create one process group per rank for nothing. `submesh` answers
    for absent ones. When both dp dimensions exist, their flattened product is
    flattened into "dp" (the mesh data loading shards over); get it with submesh(mesh, "dp").
    """
    device_type = device_type or default_device_type()
    init_distributed(device_type, timeout_seconds)
    if dist.get_world_size() != world_size:
        raise LayoutError(
            f"ParallelDims was sized for world size {world_size}, "
            f"but the process group has {dist.get_world_size()} ranks"
        )
    names = tuple(n for n in DIM_NAMES if degrees[n] > 1) or ("dp_shard",)
    shape = tuple(degrees[n] for n in names)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for name in FLATTENED:  # made now, on every rank together (each is a new process group)
        submesh(mesh, name)
    return mesh


def check_tp_fits(tp: int, divisible: dict[str, int], *, seq_len: int | None = None,
                  sequence_parallel: bool = True, gpus_per_node: int | None = None) -> None:
    """``divisible`` maps the sizes TP splits (heads, kv heads, FFN width, vocab) to their
    values. Raises one error listing every problem; warns when TP would leave a node."""
    problems = [f"tp={tp} does not divide the {what} ({size})"
                for what, size in divisible.items() if size % tp]
    if seq_len is not None and sequence_parallel and tp > 1 and seq_len % tp:
        problems.append(f"seq_len={seq_len} is not divisible by tp={tp}, which sequence parallel needs")
    if problems:
        raise LayoutError("layout does not fit the model: " + "; ".join(problems))
    if gpus_per_node and tp > gpus_per_node:
        warnings.warn(
            f"tp={tp} is larger than the {gpus_per_node} devices per node: TP collectives "
            "(several per layer) would cross the slower inter-node network",
            stacklevel=2,
        )


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The 1-D sub-mesh ``name`` ("pp", "dp_replicate", "dp_shard", "cp", "tp", or one of
    FLATTENED: "dp", "dp_shard_cp", "dp_cp"), or None where that degree is 1."""
    names = mesh.mesh_dim_names or ()
    if name in FLATTENED:
        present = [n for n in FLATTENED[name] if n in names and mesh[n].size() > 1]
        if len(present) >= 2:
            # Cached by torch after the first call (build_mesh makes them eagerly). The same
            # dimensions always get the same name ("dp", else joined), so none is made twice.
            return mesh[tuple(present)]._flatten(flat_name(present))
        return mesh[present[0]] if present else None
    if name not in DIM_NAMES:
        raise ValueError(f"unknown mesh dimension {name!r}; accepted: {', '.join(DIM_NAMES + tuple(FLATTENED))}")
    if name in names and mesh[name].size() > 1:
        return mesh[name]
    return None


def flat_name(dims: list[str]) -> str:
    """The name of the flattened dimension over ``dims`` (as submesh makes it)."""
    return "dp" if tuple(dims) == FLATTENED["dp"] else "_".join(dims)


def with_one_rank_dp(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with a "dp_shard" dimension of size 1 in its place in the order (the same
    mesh if it has one): what FSDP needs to run where there is no data parallelism."""
    names = mesh.mesh_dim_names or ()
    if "dp_shard" in names:
        return mesh
    if not names:
        raise ValueError(f"{mesh} has no dimension names; build it with ParallelDims.build_mesh")
    last = names[-1]
    shape, new = ((1, mesh.size(-1)), ("dp_shard", last)) if last == "tp" else ((mesh.size(-1), 1), (last, "dp_shard"))
    return mesh._unflatten(len(names) - 1, shape, new)


def mesh_coordinate(mesh: DeviceMesh, name: str) -> tuple[int, int]:
    """(this rank's index, degree) along ``name``; (0, 1) for an absent dimension."""
    sub = submesh(mesh, name)
    return (sub.get_local_rank(), sub.size()) if sub is not None else (0, 1)


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(device_type: str | None = None, timeout_seconds: float | None = None) -> None:
    """Start the default process group (NCCL on CUDA, gloo on CPU) unless already up.
    Works without torchrun too: a plain `python script.py` becomes a world of one.
    ``timeout_seconds``: how long a collective may wait (torch's default otherwise)."""
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {} if timeout_seconds is None else {"timeout": timedelta(seconds=timeout_seconds)}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0":
        dist.init_process_group(backend, **kwargs)
        return
    # A job restarted by torchrun (--max-restarts) can meet the key-value store of the
    # attempt before, where the dead workers' addresses still stand: gloo then connects
    # to them and fails. Each attempt gets its own key prefix.
    store, rank, world_size = next(dist.rendezvous("env://", **kwargs))
    store = dist.PrefixStore(f"meshtrain_attempt_{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


def shutdown_distributed() -> None:
    """End the process group once every rank is done with it. A rank that destroys its
    group first closes connections that a slower rank's last collective may still be
    finishing on; gloo then aborts that rank at exit ("terminate called without an
    active exception", about one 4-process CPU job in eight). The barrier closes the race."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launched_world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
