"""Count the collectives one pipeline stage issues per optimizer step, for several numbers
of micro-batches and both FSDP strategies (pp 2 x dp_shard 2, 4 processes):

    torchrun --nproc-per-node 4 tests/workers/pp_collectives.py OUT.json

Counts come from a dispatch mode that sees every c10d collective as it is dispatched
(CommDebugMode's module tracker trips over the pipeline's hooks); the collectives run
for real. The second step is counted: the first also
runs the schedule's one-time shape inference.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.models.llama import Llama
from meshtrain.parallel import ParallelDims, parallelize, shutdown_distributed, submesh
from meshtrain.parallel.pipeline import build_schedule, split_into_stages, split_layers
from meshtrain.training.step import pipeline_loss_fn, pipeline_train_step

c10d = torch.ops.c10d
ALL_GATHER = (c10d._allgather_base_, c10d.allgather_, c10d.allgather_into_tensor_coalesced_)
REDUCE_SCATTER = (c10d._reduce_scatter_base_, c10d.reduce_scatter_, c10d.reduce_scatter_tensor_coalesced_)
MICRO_BATCHES, BATCH, SEQ = (2, 4, 8), 16, 16


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        self.counts[packet] = self.counts.get(packet, 0) + 1
        return func(*args, **(kwargs or {}))


def count(strategy: str, n_micro: int, mesh) -> dict:
    pp_mesh, dp_mesh = submesh(mesh, "pp"), submesh(mesh, "dp")
    layers = split_layers(4, 2)
    (index, stage), = split_into_stages(Llama.from_flavor("debug", meta=True), pp_mesh, layers)
    parallelize(stage, mesh, sharding_strategy=strategy)
    stage.init_weights(seed=0)
    schedule = build_schedule("1F1B", [(index, stage)], pp_mesh, n_microbatches=n_micro, n_stages=2,
                              loss_fn=pipeline_loss_fn(n_micro), device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH // dp_mesh.size(), SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    step = lambda: pipeline_train_step(schedule, [stage], optimizer, batch, first=index == 0, last=index == 1,
                                       dp_mesh=dp_mesh, pp_mesh=pp_mesh)
    step()
    with CountCollectives() as comm:
        step()
    counts = comm.counts
    # A unit of several modules (norm + output) is one parameter group, gathered at once.
    groups = {id(m._get_fsdp_state()._fsdp_param_group) for m in stage.modules()
              if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None}
    units = len(groups)
    return {"stage": index, "strategy": strategy, "microbatches": n_micro, "fsdp_units": units,
            "all_gathers": sum(counts.get(op, 0) for op in ALL_GATHER),
            "reduce_scatters": sum(counts.get(op, 0) for op in REDUCE_SCATTER)}


if __name__ == "__main__":
    mesh = ParallelDims(pp=2, dp_shard=2).build_mesh("cpu")
    rows = [count(s, n, mesh) for s in ("SHARD_GRAD_OP", "FULL_SHARD") for n in MICRO_BATCHES]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump([row for rank_rows in everyone[::2] for row in rank_rows], fh, indent=1)
    shutdown_distributed()
