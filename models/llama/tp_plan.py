"""How Llama splits over a tensor-parallel group (Megatron-style, with sequence parallel).

Per block the only TP collectives are: one all-gather of the sequence before attention
and before the MLP, and one reduce-scatter after each (with sequence parallel; without
it those are a broadcast-free identity and an all-reduce). q/k/v and w1/w3 are split by
output columns, wo and w2 by input rows, so each rank computes whole heads and a slice
of the FFN width with no communication in between.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from meshtrain.models.common import megatron_block_plan, vocab_parallel_ends


def llama_tp_plan(model, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    """Module-name pattern -> ParallelStyle, for `parallelize_module`.

    With `loss_parallel`, logits stay sharded on the vocab dimension and the loss is
    computed under `torch.distributed.tensor.parallel.loss_parallel()`: the full
    [batch, seq, vocab] logits never exist on one rank.
    """
    embedding, output = vocab_parallel_ends(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = embedding
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = output
    block = megatron_block_plan(
        attention="attention", qkv=["attention.wq", "attention.wk", "attention.wv"], attention_out="attention.wo",
        mlp="feed_forward", mlp_in=["feed_forward.w1", "feed_forward.w3"], mlp_out="feed_forward.w2",
        norms=["attention_norm", "ffn_norm"], sequence_parallel=sequence_parallel,
        extra_inputs=1)  # the rotary angles: a plain tensor every rank already has
    for name in model.layers:
        plan.update({f"layers.{name}.{key}": style for key, style in block.items()})
    return plan
