"""The `hf` family's config: a Hugging Face config.json, read without importing torch or
transformers (reading a config stays fast), plus the sizes meshtrain's planner and
checkpoints talk in, filled in when the model is built (models/hf/model.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FLAVORS: dict = {}  # no presets: the shape is the config.json's


class HFModelError(ValueError):
    """The config.json (or the [model] hf_* keys) describe a model meshtrain cannot build."""


@dataclass
class HFConfig:
    hf: dict = field(default_factory=dict)   # config.json as transformers reads it
    # Derived from it by transformers (its attribute names differ per architecture):
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    ffn_hidden: int = 0
    vocab_size: int = 0
    max_seq_len: int = 0
    tie_embeddings: bool = False


# Where meshtrain's own configs/ lies, in a checkout or installed: a shipped TOML's
# `hf_config = "configs/hf/qwen2-tiny"` must resolve from any working directory.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def config_path(where: str) -> Path:
    """The config.json a `[model] hf_config` names: the file itself or its folder, relative
    to the working directory, else to meshtrain's own folder (the shipped configs/hf/)."""
    path = Path(where)
    if not path.exists() and not path.is_absolute() and (PACKAGE_ROOT / path).exists():
        path = PACKAGE_ROOT / path
    return path / "config.json" if path.is_dir() else path


def read_hf_config(where: str) -> dict:
    """config.json as a dict; HFModelError naming the file and what is wrong."""
    path = config_path(where)
    if not path.is_file():
        raise HFModelError(f'"{where}" is neither a config.json nor a folder holding one')
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise HFModelError(f"{path} is not JSON ({err})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise HFModelError(f"{path} has no \"model_type\": not a Hugging Face model config")
    return config
