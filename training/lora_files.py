"""PEFT adapter folders in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT stores an adapter of a model under ``base_model.model.`` + the model's own module
path, without the adapter's name: our ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
is its ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. Our Hugging
Face models (`[model] name = "hf"`) carry transformers' module paths, so a folder maps
onto them by that rename alone; each rank reads only its own block of each adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from meshtrain.parallel.lora import ADAPTER, is_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_name(name: str) -> str:
    """Our adapter parameter name -> PEFT's stored name."""
    return PREFIX + name.replace(f".{ADAPTER}.", ".")


def read_adapter_config(folder: str | Path) -> dict:
    """The folder's adapter_config.json; ValueError naming what is wrong with the folder."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it needs {CONFIG} and {WEIGHTS} "
                         "(as PeftModel.save_pretrained writes them)")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder / CONFIG} is not JSON ({err})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder / CONFIG} is not a LoRA adapter's config (peft_type "
                         f"{config.get('peft_type') if isinstance(config, dict) else config!r})")
    return config


def check_adapter_config(config: dict, folder: str | Path, *, rank: int, alpha: float) -> None:
    """The folder's r and lora_alpha are [lora]'s: a mismatch would train another model."""
    differ = [f"{ours} = {mine} but the folder's {theirs} = {config.get(theirs)}"
              for ours, theirs, mine in (("rank", "r", rank), ("alpha", "lora_alpha", alpha))
              if config.get(theirs) is not None and float(config[theirs]) != float(mine)]
    if config.get("use_rslora") or config.get("use_dora"):
        differ.append("the folder uses rsLoRA/DoRA, which meshtrain does not train")
    if differ:
        raise ValueError(f"{Path(folder) / CONFIG}: [lora] {'; '.join(differ)}")


@torch.no_grad()
def load_adapter_(model: torch.nn.Module, folder: str | Path) -> None:
    """Fill ``model``'s adapters (whole, a pipeline stage, or sharded with any placements)
    from a PEFT folder. A missing adapter, or one of another shape (an adapter of another
    base model or rank), is a ValueError naming it."""
    from safetensors import safe_open

    from meshtrain.models.safetensors_files import fill_from_safetensors_

    folder = Path(folder)
    weights = folder / WEIGHTS
    with safe_open(weights, framework="pt") as f:
        files = dict.fromkeys(f.keys(), weights)
    fill_from_safetensors_(model, folder, lambda name, _: peft_name(name), adapters=True, files=files)


def unused_adapters(model: torch.nn.Module, folder: str | Path) -> list[str]:
    """The folder's adapters that ``model`` (the whole model, on meta is fine) has no place
    for: modules [lora] target_modules does not name."""
    from safetensors import safe_open

    ours = {peft_name(n) for n, _ in model.named_parameters() if is_adapter(n)}
    with safe_open(Path(folder) / WEIGHTS, framework="pt") as f:
        return sorted(k for k in f.keys() if k not in ours)


def save_peft(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, *, rank: int, alpha: float, dropout: float,
              base_model: str = "") -> list[str]:
    """Write a folder `PeftModel.from_pretrained` loads: the adapters among ``tensors``
    (our names, full tensors) and their config. Returns the adapted modules' last names."""
    from safetensors.torch import save_file

    adapters = {peft_name(name): t.detach().cpu().contiguous() for name, t in tensors if is_adapter(name)}
    if not adapters:
        raise ValueError("the checkpoint holds no LoRA adapters (no lora_A/lora_B weights): it was not "
                         "trained with [lora] enable = true; export it with --format hf or torch")
    # The module names PEFT matches, as it writes them after resolving "all-linear".
    targets = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in adapters})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapters, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return targets
