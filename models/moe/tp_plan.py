"""How the MoE transformer splits over a tensor-parallel group.

Attention, the dense feed-forwards and the vocabulary split as Llama's do
(models/common.py `megatron_block_plan`). In a mixture-of-experts layer the input is
gathered to the whole sequence and every tp rank routes the same tokens: the router and
the routed experts are replicated over tp for now (Replicate DTensors, computed on this
rank's copy), the shared experts split Megatron-style (w1/w3 by columns, w2 by rows, one
all-reduce), and the output is cut back to this rank's sequence shard. Expert
parallelism (the next step) will split the routed experts instead.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel)

from meshtrain.models.common import megatron_block_plan, vocab_parallel_ends
from meshtrain.models.moe.layer import MoE


def moe_tp_plan(model, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    embedding, output = vocab_parallel_ends(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = embedding
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = output
    between = Shard(1) if sequence_parallel else Replicate()
    for name, block in model.layers.items():
        dense = not isinstance(block.feed_forward, MoE)
        style = megatron_block_plan(
            attention="attention", qkv=["attention.wq", "attention.wk", "attention.wv"],
            attention_out="attention.wo", mlp="feed_forward", mlp_in=["feed_forward.w1", "feed_forward.w3"],
            mlp_out="feed_forward.w2", norms=["attention_norm", "ffn_norm"], sequence_parallel=sequence_parallel,
            extra_inputs=1)
        if not dense:  # the experts take plain, whole-sequence tensors and give them back
            for key in ("feed_forward", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
                del style[key]
            style["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(between,), use_local_output=True)
            style["feed_forward.router"] = ReplicateParameters()
            style["feed_forward.experts"] = ReplicateParameters()
            if block.feed_forward.shared_experts is not None:
                style.update({"feed_forward.shared_experts.w1": ColwiseParallel(),
                              "feed_forward.shared_experts.w3": ColwiseParallel(),
                              "feed_forward.shared_experts.w2": RowwiseParallel()})
        plan.update({f"layers.{name}.{key}": s for key, s in style.items()})
    return plan


class ReplicateParameters(ParallelStyle):
    """Every parameter of the module a Replicate DTensor over the tp mesh, the module's
    inputs and outputs untouched: a weight each tp rank holds whole, in the same form as
    the split ones (what SequenceParallel does to a norm's weight). Weights that are DTensors
    already (routed experts that expert parallelism split over ep x tp first) stay as they are."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if all(isinstance(p, DTensor) for p in module.parameters()):
            return module
        return distribute_module(module, device_mesh)
