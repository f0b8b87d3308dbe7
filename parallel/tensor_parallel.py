"""Tensor parallelism: apply a model's plan over the tp sub-mesh; the parallel loss."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> nn.Module:
    """Shard ``model`` in place by ``plan`` (module-name pattern -> ParallelStyle;
    names may use ``*`` wildcards, e.g. "layers.*.attention.wq")."""
    return parallelize_module(model, tp_mesh, plan)


def loss_parallel_context(enabled: bool):
    """Cross-entropy on vocab-sharded logits without gathering them: each rank computes
    its slice of the log-sum-exp and one all-reduce combines them. Forward *and*
    backward of the loss must run inside this context."""
    return loss_parallel() if enabled else contextlib.nullcontext()
