"""FSDP2 x tensor parallel on your own model: one that knows nothing about meshtrain.

    torchrun --nproc-per-node 4 examples/custom_model_2d.py     # dp_shard 2 x tp 2

A model from models/ brings its own TP plan and FSDP units. A plain nn.Module does not,
so the caller passes them to `parallelize`: a TP plan (module-name pattern ->
ParallelStyle) and the block class that becomes one FSDP unit per instance.
"""

import argparse


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.parallel import ParallelDims, mesh_coordinate, parallelize, shutdown_distributed, submesh
from meshtrain.training.step import train_step

STEPS, BATCH, SEQ, VOCAB = 10, 8, 64, 256


class Block(nn.Module):
    """Pre-norm MLP block with a residual. Under TP `up` is split by output columns and
    `down` by input rows, so the GELU runs on each rank's slice of the hidden width and
    the only communication is one all-reduce after `down`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 64, hidden: int = 256, n_blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


# `*` matches any child name (parallelize_module uses fnmatch on each dotted part).
TP_PLAN = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def fixed_tokens() -> torch.Tensor:
    """The global batch: arithmetic sequences mod vocab, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    mesh = ParallelDims(dp_shard=-1, tp=args.tp).build_mesh()
    # Built in full on every rank with the same seed, so every rank holds the same weights;
    # parallelize then splits these existing weights (TP) and shards them again (FSDP).
    torch.manual_seed(0)
    model = TinyLM().to(mesh.device_type)
    model = parallelize(model, mesh, sharding_strategy="FULL_SHARD", tp_plan=TP_PLAN,
                        block_classes=(Block,))

    dp_mesh = submesh(mesh, "dp")
    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    tokens = fixed_tokens()
    per_rank = BATCH // dp_size
    local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, STEPS + 1):
        # The head is not TP-sharded, so the logits are ordinary tensors: no loss_parallel.
        loss, _ = train_step(model, optimizer, [(local[:, :-1], local[:, 1:])], max_norm=1.0,
                             loss_parallel=False, dp_mesh=dp_mesh, device=torch.device(mesh.device_type))
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)

    shutdown_distributed()


if __name__ == "__main__":
    main()
