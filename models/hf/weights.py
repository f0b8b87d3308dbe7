"""Safetensors in and out for `[model] name = "hf"`. The model's parameter names are the
Hugging Face names, so nothing is renamed or permuted: loading reads, for each parameter,
only the block this rank owns; export writes the full tensors with a config.json that
`AutoModelForCausalLM.from_pretrained` reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch

from meshtrain.models.hf.config import HFConfig
from meshtrain.models.hf.experts import StackedExperts
from meshtrain.models.safetensors_files import fill_from_safetensors_, write_safetensors
from meshtrain.parallel.init import materialize

# What must agree between the model and the folder beyond tensor shapes (checked one by one).
_SAME = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "layer_norm_eps", "tie_word_embeddings",
         "num_experts_per_tok", "norm_topk_prob")


@torch.no_grad()
def load_hf_weights_(model: torch.nn.Module, hf_dir: str | os.PathLike) -> None:
    """Fill every parameter of ``model`` (whole, a pipeline stage, or sharded with any
    placements) from a Hugging Face folder of the same architecture."""
    hf_dir = Path(hf_dir)
    theirs = json.loads((hf_dir / "config.json").read_text())
    ours = model.cfg.hf
    differ = [f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in _SAME
              if k in ours and k in theirs and ours[k] != theirs[k]]
    if differ:
        raise ValueError("the Hugging Face folder does not hold this model (model vs folder): " + "; ".join(differ))
    materialize(model)
    aliases = {alias: names[0] for names in model.tied_weights() for alias in names[1:]}
    # A tied copy is stored once, under the embedding's name; fused experts as transformers
    # saves them, one tensor per expert and projection (experts.py's StackedExperts).
    fill_from_safetensors_(model, hf_dir, lambda name, files: aliases[name] if name not in files and name in aliases
                           else name, assembled=StackedExperts.find)
    model.init_buffers()


def save_hf(tensors: Iterable[tuple[str, torch.Tensor]], cfg: HFConfig, out_dir: str | os.PathLike,
            *, max_shard_bytes: int = 5 * 10**9, dtype: torch.dtype | None = None) -> list[Path]:
    """Write a folder `from_pretrained` loads: config.json (the run's) and the weights,
    from (parameter name, full tensor) pairs, e.g. streamed from a checkpoint."""
    from meshtrain.models.hf.model import build_hf

    with torch.device("meta"):
        model = build_hf("", hf=cfg.hf)
    expected = {name for name, _ in model.named_parameters()}  # a tied copy is listed once
    out = Path(out_dir)
    written, out_dtype = write_safetensors(
        ((name, t.to(dtype or t.dtype)) for name, t in tensors if name in expected), out, expected=expected,
        max_shard_bytes=max_shard_bytes)
    config = {**cfg.hf, "dtype": str(out_dtype or torch.float32).removeprefix("torch.")}
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written
