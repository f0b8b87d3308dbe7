"""Tensor parallelism: apply a model's plan over the tp sub-mesh; the parallel loss."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from parallel.init import retie, tied_parameter_names


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> nn.Module:
    """Shard ``model`` in place by ``plan`` (module-name pattern -> ParallelStyle;
    names may use ``*`` wildcards, e.g. "layers.*.attention.wq").

    Tied parameters (one Parameter under several names, e.g. a token embedding reused
    as the output layer) stay tied: each style replaces its module's weight with a new
    DTensor, which would silently give every name its own copy, so afterwards every name
    is pointed back at the first one's. The plan must give them the same placements."""
    tied = tied_parameter_names(model)
    parallelize_module(model, tp_mesh, plan)
    for names in tied:
        source = model.get_parameter(names[0])
        for name in names[1:]:
            copy = model.get_parameter(name)
            if getattr(copy, "placements", None) != getattr(source, "placements", None):
                raise ValueError(f"tied parameters {names[0]} and {name} get different tensor-parallel "
                                 f"placements ({getattr(source, 'placements', 'not sharded')} vs "
                                 f"{getattr(copy, 'placements', 'not sharded')}); the TP plan must shard "
                                 "them alike (e.g. RowwiseParallel embedding + ColwiseParallel output)")
    retie(model, tied)
    return model


def loss_parallel_context(enabled: bool):
    """Cross-entropy on vocab-sharded logits without gathering them: each rank computes
    its slice of the log-sum-exp and one all-reduce combines them. Forward *and*
    backward of the loss must run inside this context."""
    return loss_parallel() if enabled else contextlib.nullcontext()
