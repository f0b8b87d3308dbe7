"""Hugging Face Llama checkpoints, both ways: load a `LlamaForCausalLM` folder into our
Llama (plain, pipeline stage, or already sharded by TP/FSDP), and write ours as one.

Two things differ besides names. Our rotary embedding rotates consecutive pairs
(x[2i], x[2i+1]) of each head, Meta's reference layout; Hugging Face's rotate_half pairs
x[i] with x[i + d/2]. Attention scores only see q.k, so reordering the rows of wq and wk
inside every head the same way (row 2i + j <-> row j * d/2 + i, j = 0, 1) turns one
layout into the other exactly; wv and everything else need no change. Second, a 70B model must never be
read whole by one rank: each rank reads from the safetensors files only the block of
each tensor its placements own, widened to whole heads where the reordering needs it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable

import torch

from meshtrain.models.llama.config import LlamaConfig
from meshtrain.models.safetensors_files import fill_from_safetensors_, write_safetensors
from meshtrain.parallel.init import canonical_name, materialize

# Inside layers.N. (ours) / model.layers.N. (theirs).
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK_NAMES.items()}
_TOP_BACK = {v: k for k, v in _TOP_NAMES.items()}


# ---- config.json ----

def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A config.json for `LlamaForCausalLM`. Written with rope_theta / rope_scaling, which
    transformers 4.45+ read as such and 5.x converts to its rope_parameters."""
    scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": float(low),
                   "high_freq_factor": float(high), "original_max_position_embeddings": int(original)}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.n_layers, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."), "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
    }


def config_from_hf(d: dict) -> LlamaConfig:
    """Our LlamaConfig for a Hugging Face config.json (transformers 4.x or 5.x layout).
    Anything our model would silently compute differently is refused."""
    def refuse(why: str):
        raise ValueError(f"cannot load this Hugging Face checkpoint: {why}")

    if d.get("model_type") != "llama":
        refuse(f"model_type is {d.get('model_type')!r}, only 'llama' is supported")
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    if missing := [k for k in required if k not in d]:
        refuse(f"config.json has no {', '.join(missing)}")
    for key, ours in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if d.get(key, ours) != ours:
            refuse(f"{key} is {d[key]!r}, our Llama has {ours!r}")
    if d.get("quantization_config"):
        refuse("the weights are quantized")
    dim, heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("head_dim") not in (None, dim // heads) or dim % heads:
        refuse(f"head_dim {d.get('head_dim')} is not hidden_size / num_attention_heads ({dim} / {heads})")
    # 4.x: rope_theta + rope_scaling (key "type" before 4.43); 5.x: rope_parameters holding both.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        refuse(f"unsupported rope parameters {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", d.get("rope_theta", 10_000.0))
    if rope_type == "llama3":
        scaling = (float(rope["factor"]), float(rope["low_freq_factor"]),
                   float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    elif rope_type == "default":
        scaling = None
    else:
        refuse(f"rope_type {rope_type!r}; only 'llama3' and 'default' are supported")
    return LlamaConfig(
        dim=dim, n_layers=d["num_hidden_layers"], n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads, vocab_size=d["vocab_size"],
        ffn_hidden=d["intermediate_size"], norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), rope_scaling=scaling,
        max_seq_len=d.get("max_position_embeddings", 2048),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


# ---- names and the rotary permutation ----

def to_hf_name(name: str) -> str:
    """Our parameter name (wrapper prefixes allowed) -> the Hugging Face tensor name."""
    name = canonical_name(name)
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    raise ValueError(f"{name!r} is not a Llama parameter name")


def from_hf_name(name: str) -> str:
    """A Hugging Face tensor name -> our parameter name."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _BLOCK_BACK:
        return f"layers.{parts[2]}.{_BLOCK_BACK[parts[3]]}"
    raise ValueError(f"{name!r} is not a LlamaForCausalLM tensor name")


def rotary_heads(name: str, cfg: LlamaConfig) -> int | None:
    """How many heads' rows to reorder in this tensor (wq: heads, wk: kv heads), else None."""
    name = canonical_name(name)
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from our pairs (2i, 2i+1) to HF's (i, i + d/2): row 2i+j -> j*d/2+i."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_half`."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ---- loading ----

def _check_same_model(cfg: LlamaConfig, hf: LlamaConfig) -> None:
    """What tensor shapes cannot reveal: layer count, how dim splits into heads, rotary
    frequencies, norm epsilon. (Sizes are checked tensor by tensor, naming the tensor.)"""
    differ = [f"{f} {getattr(cfg, f)} vs {getattr(hf, f)}"
              for f in ("n_layers", "n_heads", "n_kv_heads", "rope_theta", "rope_scaling")
              if getattr(cfg, f) != getattr(hf, f)]
    if not math.isclose(cfg.norm_eps, hf.norm_eps, rel_tol=1e-6):
        differ.append(f"norm_eps {cfg.norm_eps} vs {hf.norm_eps}")
    if cfg.tie_embeddings and not hf.tie_embeddings:
        differ.append("the model ties its embeddings, the checkpoint has a separate lm_head")
    if differ:
        raise ValueError("the Hugging Face checkpoint does not match the model (model vs checkpoint): "
                         + "; ".join(differ))


@torch.no_grad()
def load_hf_weights_(model: torch.nn.Module, hf_dir: str | os.PathLike) -> None:
    """Fill every parameter of ``model`` (our Llama: plain, a pipeline stage, or sharded
    by TP/FSDP with any placements) in place from a Hugging Face Llama folder.

    Each rank reads only its own block of each tensor, so peak extra memory is about one
    local shard. A model on meta is materialized first; the rotary tables are rebuilt.
    """
    hf_dir = Path(hf_dir)
    config = hf_dir / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} not found: not a Hugging Face model folder")
    hf_cfg = config_from_hf(json.loads(config.read_text()))
    cfg: LlamaConfig = model.cfg
    _check_same_model(cfg, hf_cfg)
    materialize(model)

    def stored_name(name: str, files: dict) -> str:
        hf_name = to_hf_name(name)
        if hf_name == "lm_head.weight" and hf_name not in files and hf_cfg.tie_embeddings:
            return "model.embed_tokens.weight"  # tied: the file holds the embedding only
        return hf_name

    def read_block(source, shape, offset, name):
        return _read_block(source, shape, offset, rotary_heads(name, cfg) is not None, cfg.head_dim)

    fill_from_safetensors_(model, hf_dir, stored_name, read_block)
    model.init_buffers()


def _read_block(source, shape, offset, rotary: bool, head_dim: int) -> torch.Tensor:
    """The block [offset, offset + shape) of the tensor in our layout. For wq/wk the rows
    are read as whole heads (a head's rows are reordered among themselves), then narrowed."""
    index = [slice(o, o + s) for o, s in zip(offset, shape)]
    if not rotary:
        return source[tuple(index)]
    start, stop = offset[0], offset[0] + shape[0]
    first, last = start // head_dim, -(-stop // head_dim)  # heads overlapping the rows
    index[0] = slice(first * head_dim, last * head_dim)
    block = half_to_interleaved(source[tuple(index)], last - first)
    return block[start - first * head_dim: stop - first * head_dim]


# ---- saving ----

def save_hf(tensors: Iterable[tuple[str, torch.Tensor]], cfg: LlamaConfig, out_dir: str | os.PathLike,
            *, max_shard_bytes: int = 5 * 10**9, dtype: torch.dtype | None = None) -> list[Path]:
    """Write a Hugging Face Llama folder (config.json + safetensors) from (our name, full
    tensor) pairs, e.g. streamed from a checkpoint. Files past ``max_shard_bytes`` start a
    new shard (model-0000i-of-0000N.safetensors + index), so at most one shard is held in
    memory. ``dtype`` converts (default: as given). Returns the weight files written."""
    expected = {to_hf_name(f"layers.{i}.{n}") for i in range(cfg.n_layers) for n in _BLOCK_NAMES}
    expected |= {v for k, v in _TOP_NAMES.items() if not (cfg.tie_embeddings and k == "output.weight")}

    def converted():
        for name, tensor in tensors:
            hf_name = to_hf_name(name)
            if cfg.tie_embeddings and hf_name == "lm_head.weight":
                continue  # tied: transformers rebuilds lm_head from embed_tokens
            t = tensor.to(dtype=dtype or tensor.dtype)
            if (heads := rotary_heads(name, cfg)) is not None:
                t = interleaved_to_half(t, heads)
            yield hf_name, t

    out = Path(out_dir)
    written, out_dtype = write_safetensors(converted(), out, expected=expected, max_shard_bytes=max_shard_bytes)
    config = config_to_hf(cfg, out_dtype or torch.float32)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written
