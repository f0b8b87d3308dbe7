"""Train the debug Llama a few steps under one parallel layout and record losses, gradient
norms and full weights (at init and at the end). Run with no process group for the
single-process reference, or under torchrun for a layout:

    torchrun --nproc-per-node 4 tests/workers/parity.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from models.llama import Llama
from parallel import ParallelDims, parallelize, submesh
from training.step import train_step

STEPS, BATCH, SEQ, LR, MAX_NORM = 8, 8, 32, 1e-3, 0.5

# name -> (ParallelDims kwargs, sharding strategy, model overrides)
LAYOUTS = {
    "fsdp4": (dict(dp_shard=4), "FULL_SHARD", {}),
    "tp4": (dict(tp=4, dp_shard=1), "FULL_SHARD", {}),
    "dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", {}),
    "hsdp2x2": (dict(dp_replicate=2, dp_shard=2), "HYBRID_SHARD", {}),
    "hsdp_zero2_2x2": (dict(dp_replicate=2, dp_shard=2), "HYBRID_SHARD_ZERO2", {}),
    "shard_grad_op4": (dict(dp_shard=4), "SHARD_GRAD_OP", {}),
    "no_shard4": (dict(dp_shard=4), "NO_SHARD", {}),
    "no_shard2_tp2": (dict(dp_shard=2, tp=2), "NO_SHARD", {}),
    # GQA with one kv head per TP rank shared by 4 query heads.
    "gqa_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(n_kv_heads=2)),
    "tp2_no_sp": (dict(dp_shard=2, tp=2), "FULL_SHARD", {}),
    # A vocab of 250 does not split evenly over 4 FSDP ranks (63, 63, 63, 61 rows).
    "uneven_fsdp4": (dict(dp_shard=4), "FULL_SHARD", dict(vocab_size=250)),
    "uneven_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(vocab_size=250)),
}
NO_SEQUENCE_PARALLEL = {"tp2_no_sp"}


def batches(vocab_size: int) -> torch.Tensor:
    """Learnable token streams (arithmetic progressions mod vocab), fixed by a seed."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, vocab_size, (STEPS, BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (STEPS, BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % vocab_size


def full_weights(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def run(layout: str | None, model_overrides: dict | None = None) -> dict:
    """``layout=None``: the single-process reference (no process group, plain tensors)."""
    dims, strategy, overrides = LAYOUTS[layout] if layout else ({}, "FULL_SHARD", model_overrides or {})
    model = Llama.from_flavor("debug", meta=True, **overrides)
    dp_rank, dp_size, dp_mesh, tp_mesh = 0, 1, None, None
    if layout is not None:
        mesh = ParallelDims(**dims).build_mesh()
        model = parallelize(model, mesh, sharding_strategy=strategy,
                            sequence_parallel=layout not in NO_SEQUENCE_PARALLEL)
        dp_mesh, tp_mesh = submesh(mesh, "dp"), submesh(mesh, "tp")
        if dp_mesh is not None:
            dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    model.init_weights(seed=0)
    result = {"init": full_weights(model), "losses": [], "grad_norms": []}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    per_rank = BATCH // dp_size
    for tokens in batches(model.cfg.vocab_size):
        local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        loss, norm = train_step(model, optimizer, [(local[:, :-1], local[:, 1:])], max_norm=MAX_NORM,
                                loss_parallel=tp_mesh is not None, dp_mesh=dp_mesh)
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
    result["final"] = full_weights(model)
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        result = run(name)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    dist.destroy_process_group()
