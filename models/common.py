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
    and checkpoints do not depend on where the cut falls. Copying a meta model allocates
    nothing; the blocks and modules the stage does not keep are not copied at all (they
    enter the copy as None and are removed): copying all of a 126-block model for each
    stage took 0.4 s of Python."""
    keep = {str(i) for i in layer_ids}
    left_out = [block for name, block in model.layers.items() if name not in keep]
    left_out += [getattr(model, name) for name in drop if getattr(model, name) is not None]
    stage = copy.deepcopy(model, {id(module): None for module in left_out})
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


def megatron_block_plan(*, attention: str, qkv: list[str], attention_out: str, mlp: str, mlp_in: list[str],
                        mlp_out: str, norms: list[str], sequence_parallel: bool, extra_inputs: int = 0) -> dict:
    """The TP plan of one transformer block, Megatron-style: q/k/v and the MLP's input
    projections split by output columns (each rank computes whole heads and a slice of the
    MLP width), the two output projections by input rows; nothing is communicated inside
    attention or the MLP. With sequence parallel the activations between sub-layers are
    sequence-sharded (the norms run on shards), so each sub-layer costs one all-gather in
    and one reduce-scatter out; without it, an all-reduce out. ``extra_inputs``: arguments
    of attention's forward after x that every rank already holds (rotary tables)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    between = Shard(1) if sequence_parallel else Replicate()
    plain = (None,) * extra_inputs
    plan = {
        attention: PrepareModuleInput(input_layouts=(between, *plain), desired_input_layouts=(Replicate(), *plain)),
        **{name: ColwiseParallel() for name in qkv},
        attention_out: RowwiseParallel(output_layouts=between),
        mlp: PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        **{name: ColwiseParallel() for name in mlp_in},
        mlp_out: RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan.update({name: SequenceParallel() for name in norms})
    return plan


def vocab_parallel_ends(*, sequence_parallel: bool, loss_parallel: bool) -> tuple:
    """(embedding style, output style): the embedding table split by vocabulary rows (each
    rank looks up its rows; the partial sums are reduced onto the sequence shards), the
    output layer by vocabulary columns. With ``loss_parallel`` its logits stay sharded by
    vocabulary and the loss runs under torch's `loss_parallel()`: the full [batch, seq,
    vocab] logits never exist on one rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    between = Shard(1) if sequence_parallel else Replicate()
    embedding = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    output = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                             use_local_output=not loss_parallel)
    return embedding, output
