"""Tiny transformers config.json files for the `[model] name = "hf"` tests: each
architecture with 2 layers of width 64 and a vocabulary of 320 (the debug tokenizer's 258
bytes fit), chosen for what it exercises (tests/test_hf_toml.py's docstring)."""

from __future__ import annotations

import json

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=320, max_position_embeddings=128, pad_token_id=None,
              bos_token_id=0, eos_token_id=0, initializer_range=0.02)
ARCHS = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], tie_word_embeddings=False),
    # Qwen3: per-head q/k norms, whole on every TP rank ("replicated_with_grad_allreduce").
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16, tie_word_embeddings=False),
    # GPT-2: Conv1D projections, no TP or pipeline plan, learned positions, tied embeddings.
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=64, n_head=4,
                 vocab_size=320, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 bos_token_id=0, eos_token_id=0),
    # GPT-NeoX: its plan splits the embedding itself ("embedding_rowwise"); per-head fused
    # query_key_value, partial rotary, parallel residual, a dropout listed in its pipeline plan.
    "gpt_neox": dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=64,
                     intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=320,
                     max_position_embeddings=128, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                     initializer_range=0.02),
    # Granite: embedding, residual, attention and logit multipliers; tied embeddings.
    "granite": dict(model_type="granite", architectures=["GraniteForCausalLM"], embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
                    tie_word_embeddings=True),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    # Qwen3-MoE: transformers' fused routed experts (8, top 2, renormalised), split by
    # expert parallelism; the first block dense; per-head q/k norms as Qwen3's.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=16,
                      num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False),
}


def write_config(folder, arch: str):
    """ARCHS[arch] as FOLDER/config.json; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    config = ARCHS[arch] if arch in ("gpt2", "gpt_neox") else {**COMMON, **ARCHS[arch]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def extra_config(tmp_path, name: str, **config) -> str:
    """A config.json of exactly ``config`` in TMP_PATH/NAME; returns the folder."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
