"""Pipeline x FSDP2 x tensor parallel on the debug Llama, through the programmatic API:
cut the meta model into stages, parallelize each stage, run them with a schedule.

    torchrun --nproc-per-node 4 examples/compose_3d.py                 # pp 2 x dp_shard 2
    torchrun --nproc-per-node 8 examples/compose_3d.py --tp 2          # pp 2 x dp_shard 2 x tp 2
    torchrun --nproc-per-node 2 examples/compose_3d.py --schedule Interleaved1F1B

It trains on the same batch as examples/compose_2d.py and prints the same losses.
"""

import argparse


import torch
import torch.distributed as dist
from torch import nn

from compose_2d import BATCH, STEPS, fixed_batch
from meshtrain.models.llama import Llama
from meshtrain.parallel import (SCHEDULES, ParallelDims, build_schedule, mesh_coordinate, parallelize,
                      shutdown_distributed, split_into_stages, split_layers, submesh)
from meshtrain.training.step import pipeline_loss_fn, pipeline_train_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--schedule", default="1F1B", choices=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()

    mesh = ParallelDims(pp=args.pp, tp=args.tp, dp_shard=-1).build_mesh()
    pp_mesh, dp_mesh, tp_mesh = submesh(mesh, "pp"), submesh(mesh, "dp"), submesh(mesh, "tp")
    model = Llama.from_flavor("debug", meta=True)

    # One stage per rank for 1F1B/GPipe, two (looped or V-shaped) for the others.
    per_rank, style = (1, "loop") if SCHEDULES[args.schedule][0] == "one" else (2, SCHEDULES[args.schedule][1])
    layers = split_layers(model.cfg.n_layers, args.pp * per_rank)       # e.g. [[0, 1], [2, 3]]
    parts = split_into_stages(model, pp_mesh, layers, style=style)     # [(stage index, module)]
    for _, stage in parts:
        # "auto" = SHARD_GRAD_OP under a pipeline: gathered once per step, not per micro-batch.
        parallelize(stage, mesh, sharding_strategy="auto")
        stage.init_weights(seed=0)                                      # same weights as one process
    stages = [stage for _, stage in parts]
    schedule = build_schedule(args.schedule, parts, pp_mesh, n_microbatches=args.microbatches,
                              n_stages=len(layers), loss_fn=pipeline_loss_fn(args.microbatches),
                              device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    per_rank_batch = BATCH // dp_size
    local = fixed_batch(model.cfg.vocab_size)[dp_rank * per_rank_batch:(dp_rank + 1) * per_rank_batch]
    ids = [i for i, _ in parts]
    optimizer = torch.optim.AdamW(nn.ModuleList(stages).parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(1, STEPS + 1):
        # The first stage feeds tokens, the last computes the loss; every rank gets both numbers.
        loss, grad_norm = pipeline_train_step(schedule, stages, optimizer, [(local[:, :-1], local[:, 1:])],
                                              first=0 in ids, last=len(layers) - 1 in ids, max_norm=1.0,
                                              loss_parallel=tp_mesh is not None, dp_mesh=dp_mesh, pp_mesh=pp_mesh)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.6f} grad_norm {grad_norm:.4f}", flush=True)

    shutdown_distributed()


if __name__ == "__main__":
    main()
