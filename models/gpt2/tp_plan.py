"""How GPT-2 splits over a tensor-parallel group (Megatron-style, with sequence parallel).

The blocks split like Llama's: q/k/v and fc by output columns (each rank whole heads and
a slice of the MLP width, with their biases), wo and proj by input rows (their biases
replicated and added once, after the reduction). Per block that is one all-gather of the
sequence before attention and before the MLP and one reduce-scatter after each.

The ends are where GPT-2 differs. Token and position embeddings are both split by rows
(vocabulary / positions): each lookup yields partial sums that are reduce-scattered
onto the sequence shards, so both arrive sharded alike and add up locally. The output
layer is split by vocabulary rows too, i.e. the *same* Shard(0) placement as the token
embedding: that is what lets the tied weight stay one DTensor under TP.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from meshtrain.models.common import megatron_block_plan, vocab_parallel_ends


def gpt2_tp_plan(model, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    """Module-name pattern -> ParallelStyle, for `parallelize_module`."""
    embedding, output = vocab_parallel_ends(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    plan = {}
    if model.wte is not None:
        plan["wte"] = embedding
        plan["wpe"] = embedding  # positions split by rows too: both lookups arrive sharded alike
    if model.lm_head is not None:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = output
    block = megatron_block_plan(
        attention="attn", qkv=["attn.wq", "attn.wk", "attn.wv"], attention_out="attn.wo",
        mlp="mlp", mlp_in=["mlp.fc"], mlp_out="mlp.proj", norms=["ln_1", "ln_2"],
        sequence_parallel=sequence_parallel)
    for name in model.layers:
        plan.update({f"layers.{name}.{key}": style for key, style in block.items()})
    return plan
