"""How Llama splits over a tensor-parallel group (Megatron-style, with sequence parallel).

Per block the only TP collectives are: one all-gather of the sequence before attention
and before the MLP, and one reduce-scatter after each (with sequence parallel; without
it those are a broadcast-free identity and an all-reduce). q/k/v and w1/w3 are split by
output columns, wo and w2 by input rows, so each rank computes whole heads and a slice
of the FFN width with no communication in between.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def llama_tp_plan(model, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    """Module-name pattern -> ParallelStyle, for `parallelize_module`.

    With `loss_parallel`, logits stay sharded on the vocab dimension and the loss is
    computed under `torch.distributed.tensor.parallel.loss_parallel()`: the full
    [batch, seq, vocab] logits never exist on one rank.
    """
    # Activations between blocks: sharded on the sequence dim (SP) or replicated.
    between = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel() if sequence_parallel else None

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and norm_style is not None:
        plan["norm"] = norm_style
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    block = {
        # The rotary tables (cos, sin) are plain tensors every rank already has.
        "attention": PrepareModuleInput(
            input_layouts=(between, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if norm_style is not None:
        block["attention_norm"] = norm_style
        block["ffn_norm"] = norm_style
    for name in model.layers:
        plan.update({f"layers.{name}.{key}": style for key, style in block.items()})
    return plan
