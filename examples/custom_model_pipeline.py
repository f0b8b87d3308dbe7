"""Pipeline stages x FSDP2 (x tensor parallel) on your own model: the TinyLM of
examples/custom_model_2d.py, which knows nothing about meshtrain.

    torchrun --nproc-per-node 4 examples/custom_model_pipeline.py            # pp 2 x dp_shard 2
    torchrun --nproc-per-node 8 examples/custom_model_pipeline.py --tp 2     # pp 2 x dp_shard 2 x tp 2

A model from models/ knows how to cut itself into stages (`pipeline_stage`). Yours needs
one small module saying what a stage runs, given to `split_into_stages` as `make_stage`;
after that each stage is parallelized like any model (TP plan + block class), and
`build_schedule` runs them. It prints the losses of `custom_model_2d.py --tp 1`.
"""

import argparse
from functools import partial


import torch
import torch.distributed as dist
from torch import nn

from custom_model_2d import BATCH, STEPS, TP_PLAN, Block, TinyLM, fixed_tokens
from meshtrain.parallel import (ParallelDims, build_schedule, mesh_coordinate, parallelize, split_into_stages,
                      shutdown_distributed, split_layers, submesh)
from meshtrain.training.step import pipeline_loss_fn, pipeline_train_step


class Stage(nn.Module):
    """Blocks ``layer_ids`` of a TinyLM, plus its embedding on the first stage and its
    norm and head on the last. Between stages flow hidden states [batch, seq, dim]."""

    def __init__(self, model: TinyLM, layer_ids: list[int], *, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in layer_ids)
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)) if self.head is not None else h


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()

    mesh = ParallelDims(pp=args.pp, tp=args.tp, dp_shard=-1).build_mesh()
    pp_mesh, dp_mesh = submesh(mesh, "pp"), submesh(mesh, "dp")
    device = torch.device(mesh.device_type)
    torch.manual_seed(0)  # every rank builds the same full model, then keeps its stage
    model = TinyLM().to(device)

    layers = split_layers(len(model.blocks), args.pp)  # [[0, 1], [2, 3]]
    parts = split_into_stages(model, pp_mesh, layers, make_stage=partial(Stage, model))
    del model  # the stages hold what this rank runs; the other blocks can go
    for _, stage in parts:  # "auto" = SHARD_GRAD_OP under a pipeline: one all-gather per step
        parallelize(stage, mesh, sharding_strategy="auto", tp_plan=TP_PLAN, block_classes=(Block,))
    stages = [stage for _, stage in parts]
    schedule = build_schedule("1F1B", parts, pp_mesh, n_microbatches=args.microbatches, n_stages=len(layers),
                              loss_fn=pipeline_loss_fn(args.microbatches), device=device)

    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    per_rank = BATCH // dp_size
    local = fixed_tokens()[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    ids = [i for i, _ in parts]
    optimizer = torch.optim.AdamW(nn.ModuleList(stages).parameters(), lr=1e-3)
    for step in range(1, STEPS + 1):
        loss, _ = pipeline_train_step(schedule, stages, optimizer, [(local[:, :-1], local[:, 1:])],
                                      first=0 in ids, last=len(layers) - 1 in ids, max_norm=1.0,
                                      dp_mesh=dp_mesh, pp_mesh=pp_mesh, device=device)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)

    shutdown_distributed()


if __name__ == "__main__":
    main()
