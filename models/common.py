"""What every model family in models/ does the same way: build a named shape (on meta or
initialized), list its FSDP units, and cut a pipeline stage out of the whole model."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn


def build_from_flavor(cls, flavors: dict, family: str, flavor: str, *, meta: bool, overrides: dict):
    """``cls(flavors[flavor] with overrides)``. ``meta=True`` allocates nothing: parallelize
    first, then ``init_weights`` materializes only this rank's shards."""
    if flavor not in flavors:
        raise ValueError(f"unknown {family} flavor {flavor!r}; accepted: {', '.join(flavors)}")
    with torch.device("meta" if meta else "cpu"):
        model = cls(replace(flavors[flavor], **overrides))
    if not meta:
        model.init_weights()
    return model


def cut_stage(model: nn.Module, layer_ids: list[int], *, drop: list[str]) -> nn.Module:
    """A copy of ``model`` keeping only ``layer_ids`` of its ``layers`` ModuleDict, with the
    attributes in ``drop`` set to None. Parameter names stay the whole model's, so init
    and checkpoints do not depend on where the cut falls. Copying a meta model is free."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in [n for n in stage.layers if n not in keep]:
        del stage.layers[name]
    for name in drop:
        setattr(stage, name, None)
    return stage


def fsdp_units(blocks, embeddings: list, head: list, *, tied: bool) -> list:
    """FSDP units in forward order: the embeddings, each block, the head (final norm and
    output, gathered together: they run back to back). Modules that are None (absent on
    this pipeline stage) are skipped. Tied embeddings and head on the same stage form one
    unit: a weight can only belong to one."""
    embeddings = [m for m in embeddings if m is not None]
    head = [m for m in head if m is not None]
    units = list(blocks)
    if tied and embeddings and head:
        return units + [embeddings + head]
    first = [embeddings[0] if len(embeddings) == 1 else embeddings] if embeddings else []
    return first + units + ([head] if head else [])
