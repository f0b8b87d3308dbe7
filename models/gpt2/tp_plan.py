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

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def gpt2_tp_plan(model, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    """Module-name pattern -> ParallelStyle, for `parallelize_module`."""
    between = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel() if sequence_parallel else None

    plan = {}
    if model.wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
        plan["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.lm_head is not None:
        if norm_style is not None:
            plan["ln_f"] = norm_style
        plan["lm_head"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    block = {
        "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=between),
        "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=between),
    }
    if norm_style is not None:
        block["ln_1"] = norm_style
        block["ln_2"] = norm_style
    for name in model.layers:
        plan.update({f"layers.{name}.{key}": style for key, style in block.items()})
    return plan
