"""FSDP2 x tensor parallel on the debug Llama, through the programmatic API.

    torchrun --nproc-per-node 4 examples/compose_2d.py          # dp_shard 2 x tp 2
    torchrun --nproc-per-node 4 examples/compose_2d.py --tp 4   # tp 4 only
    python examples/compose_2d.py --tp 1                        # a world of one

Every layout trains on the same global batch from the same initial weights, so all of
them print the same losses (up to float rounding).
"""

import argparse


import torch
import torch.distributed as dist

from meshtrain.models.llama import Llama
from meshtrain.parallel import ParallelDims, mesh_coordinate, parallelize, shutdown_distributed, submesh
from meshtrain.training.step import train_step

STEPS, BATCH, SEQ = 10, 8, 64  # BATCH is the global batch, split over data-parallel ranks


def fixed_batch(vocab_size: int) -> torch.Tensor:
    """Arithmetic token sequences mod vocab: easy to learn, identical on every rank."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab_size, (BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % vocab_size


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    dims = ParallelDims(dp_shard=-1, tp=args.tp)            # -1: infer from WORLD_SIZE
    mesh = dims.build_mesh()                                # cuda+nccl if present, else cpu+gloo
    model = Llama.from_flavor("debug", meta=True)           # no rank ever holds the full model
    model = parallelize(model, mesh, sharding_strategy="FULL_SHARD", mixed_precision=None)
    model.init_weights(seed=0)                              # same full weights on every layout

    # Ranks of one TP group must see the same data; only the dp coordinate picks a slice.
    dp_mesh, tp_mesh = submesh(mesh, "dp"), submesh(mesh, "tp")
    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    per_rank = BATCH // dp_size
    local = fixed_batch(model.cfg.vocab_size)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    inputs, labels = local[:, :-1], local[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(1, STEPS + 1):
        # With TP the model's plan keeps the logits vocab-sharded (loss_parallel).
        loss, grad_norm = train_step(model, optimizer, [(inputs, labels)], max_norm=1.0,
                                     loss_parallel=tp_mesh is not None, dp_mesh=dp_mesh)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.6f} grad_norm {grad_norm:.4f}", flush=True)

    shutdown_distributed()


if __name__ == "__main__":
    main()
