"""Safetensors in and out for `[model] name = "hf"`. The model's parameter names are the
Hugging Face names, so nothing is renamed or permuted: loading reads, for each parameter,
only the block this rank owns; export writes the full tensors with a config.json that
`AutoModelForCausalLM.from_pretrained` reads."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from models.hf.config import HFConfig
from models.safetensors_files import tensor_files, write_safetensors
from parallel.init import canonical_name, materialize

# What must agree between the model and the folder beyond tensor shapes (checked one by one).
_SAME = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "layer_norm_eps", "tie_word_embeddings")


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
    files = tensor_files(hf_dir)
    aliases = {alias: names[0] for names in model.tied_weights() for alias in names[1:]}
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}
        for name, param in model.named_parameters():
            name = canonical_name(name)
            stored = name if name in files or name not in aliases else aliases[name]  # tied: stored once
            if stored not in files:
                raise ValueError(f"{name} is missing from the weights in {hf_dir}")
            if files[stored] not in opened:
                opened[files[stored]] = stack.enter_context(safe_open(files[stored], framework="pt"))
            source = opened[files[stored]].get_slice(stored)
            if tuple(source.get_shape()) != tuple(param.shape):
                raise ValueError(f"{stored} has shape {tuple(source.get_shape())} in {hf_dir}, but the model's "
                                 f"is {tuple(param.shape)}")
            local = param.to_local() if isinstance(param, DTensor) else param
            shape, offset = tuple(param.shape), (0,) * param.dim()
            if isinstance(param, DTensor):  # the block this rank owns, as in parallel.init
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                      param.placements)
            if local.numel():  # else an FSDP rank past the end of a short dimension
                local.copy_(source[tuple(slice(o, o + s) for o, s in zip(offset, shape))])
    model.init_buffers()


def save_hf(tensors: Iterable[tuple[str, torch.Tensor]], cfg: HFConfig, out_dir: str | os.PathLike,
            *, max_shard_bytes: int = 5 * 10**9, dtype: torch.dtype | None = None) -> list[Path]:
    """Write a folder `from_pretrained` loads: config.json (the run's) and the weights,
    from (parameter name, full tensor) pairs, e.g. streamed from a checkpoint."""
    from models.hf.model import build_hf

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
