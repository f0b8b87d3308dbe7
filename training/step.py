"""One optimizer step: forward/backward over the micro-batches, clip, update.

The loss is the mean cross-entropy over every token of the global batch. Each
data-parallel rank averages over its own tokens and divides by the number of
micro-batches; FSDP then averages gradients over the data-parallel ranks. Every rank
sees the same number of tokens, so this equals the single-process mean exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallel import clip_grad_norm_, loss_parallel_context


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # fp32 for the softmax whatever the compute dtype: bf16 log-sum-exp over 128K
    # classes loses the small probabilities the gradient is made of.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def train_step(model, optimizer, micro_batches, *, max_norm: float = 0.0,
               loss_parallel: bool = False, dp_mesh: DeviceMesh | None = None,
               device: torch.device | None = None) -> tuple[float, float]:
    """Returns (loss averaged over the global batch, global gradient norm before clipping).
    ``loss_parallel``: the logits are vocab-sharded DTensors (TP with loss_parallel)."""
    if device is None:  # where the parameters (or their local shards) live
        param = next(model.parameters())
        device = param.to_local().device if isinstance(param, DTensor) else param.device
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for inputs, labels in micro_batches:
        inputs, labels = inputs.to(device), labels.to(device)
        with loss_parallel_context(loss_parallel):
            loss = cross_entropy(model(inputs), labels) / len(micro_batches)
            loss.backward()
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    if dp_mesh is not None:
        # Reporting only: the gradients were already averaged by FSDP.
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
    return total.item(), grad_norm.item()
