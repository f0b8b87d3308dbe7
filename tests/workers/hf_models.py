"""Train Hugging Face models as their users bring them -- transformers' own
GPT2LMHeadModel and LlamaForCausalLM, built from a tiny config, no wrapper -- under a
few layouts, and record losses, gradient norms and full weights (at init and at the end)
for tests/test_hf_models.py to judge against plain PyTorch:

    torchrun --nproc-per-node 4 tests/workers/hf_models.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from meshtrain.parallel import ParallelDims, mesh_coordinate, parallelize, submesh
from meshtrain.parallel.init import canonical_name
from meshtrain.training.step import train_step
from tests.workers.layouts import save_each_layout

# Gradient norms are about 1: clipping to 0.1 rescales every step by a different factor,
# which Adam does not cancel out (it would a constant one), and lr 3e-3 lets that show
# in the losses, so the oracle can tell a layout that skipped clipping.
STEPS, BATCH, SEQ, LR, MAX_NORM, WEIGHT_DECAY = 8, 8, 32, 3e-3, 0.1, 0.1
VOCAB, N_LAYERS = 256, 2


def gpt2_config() -> GPT2Config:
    return GPT2Config(n_layer=N_LAYERS, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")


def llama_config() -> LlamaConfig:
    # GQA: 4 query heads share 2 kv heads, so each of 2 TP ranks holds 2 + 1 of them.
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=N_LAYERS, vocab_size=VOCAB, max_position_embeddings=64,
                       attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                       tie_word_embeddings=False, attn_implementation="sdpa")


MODELS = {"gpt2": (GPT2LMHeadModel, gpt2_config), "llama": (LlamaForCausalLM, llama_config)}

# Keys are module paths from the model passed to parallelize, here LlamaForCausalLM: its
# decoder layers sit under "model.". Embeddings and lm_head stay whole (FSDP alone shards
# them), so the logits are ordinary tensors and no loss_parallel is needed.
LLAMA_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}

# name -> (ParallelDims kwargs, model family, parallelize kwargs). "blocks" names the
# attribute path of the block container to pass as blocks= (built per model).
LAYOUTS = {
    "gpt2_full_shard_ac": (dict(dp_shard=4), "gpt2", dict(
        sharding_strategy="FULL_SHARD", block_classes=(GPT2Block,), activation_checkpoint="full")),
    "gpt2_shard_grad_op": (dict(dp_shard=4), "gpt2", dict(
        sharding_strategy="SHARD_GRAD_OP", block_classes=(GPT2Block,))),
    "llama_dp2_tp2_ac": (dict(dp_shard=2, tp=2), "llama", dict(
        sharding_strategy="FULL_SHARD", tp_plan=LLAMA_TP_PLAN, block_classes=(LlamaDecoderLayer,),
        activation_checkpoint="full", blocks="model.layers")),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The Hugging Face model, initialized by transformers from ``seed`` (the same on every
    rank, so every rank starts from the same full weights, as with FSDP1)."""
    cls, config = MODELS[family]
    torch.manual_seed(seed)
    return cls(config())


def batches() -> torch.Tensor:
    """Learnable token streams (arithmetic progressions mod vocab), fixed by a seed:
    [STEPS, BATCH, SEQ + 1]."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (STEPS, BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (STEPS, BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter in full, under the name the unwrapped model gives it."""
    return {canonical_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def tp_sharded(model) -> list[str]:
    """Names of the parameters split over the tp dimension (a plan that matched nothing
    would still train, and match the oracle, with none)."""
    return sorted(canonical_name(name) for name, p in model.named_parameters()
                  if isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names)


def run(layout: str) -> dict:
    dims, family, kwargs = LAYOUTS[layout]
    mesh = ParallelDims(**dims).build_mesh()
    model = build(family)
    kwargs = dict(kwargs)
    if "blocks" in kwargs:
        kwargs["blocks"] = model.get_submodule(kwargs["blocks"])
    model = parallelize(model, mesh, **kwargs)
    dp_mesh = submesh(mesh, "dp")
    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    result = {"init": full_weights(model), "losses": [], "grad_norms": [], "tp_sharded": tp_sharded(model)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    per_rank = BATCH // dp_size
    for tokens in batches():
        local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        # The model returns a CausalLMOutput; train_step takes its .logits.
        loss, norm = train_step(model, optimizer, [(local[:, :-1], local[:, 1:])], max_norm=MAX_NORM,
                                dp_mesh=dp_mesh)
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
    result["final"] = full_weights(model)
    return result


if __name__ == "__main__":
    save_each_layout(run)
