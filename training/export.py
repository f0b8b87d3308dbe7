"""Export a training checkpoint to Hugging Face format (families with a converter in
models/registry.py: Llama) or one consolidated torch file (any family).

    meshtrain export CHECKPOINT_DIR OUT --format hf|torch|peft [--dtype bfloat16|float32] [--merge-lora]

A checkpoint is a torch.distributed.checkpoint (DCP) folder written by any layout: model
weights under the keys ``model.<parameter name>``, plus ``model_config.json`` (the
model's config as JSON; ``job_config.toml`` says which family). DCP reassembles each full tensor from the shards of all ranks, so
this runs in one process with no process group, reading one tensor at a time: format hf
holds at most one output shard in memory, format torch (``torch.load`` of a dict of our
parameter names) the whole model. Other keys (optimizer state, data position) are ignored.

A checkpoint of a `[lora]` run holds the frozen base and the adapters: format peft writes
the adapters alone as PEFT saves them (training/lora_files.py), for `[model] name = "hf"`;
``--merge-lora`` folds each adapter into its weight, W + alpha/rank * B A, for format hf
or torch (any family with a converter).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.models import registry
from meshtrain.parallel.init import canonical_name
from meshtrain.parallel.lora import ADAPTER, is_adapter
from meshtrain.training.checkpoint import root_cause
from meshtrain.training.checkpoint_reader import SafeReader, tensor_damage
from meshtrain.training.export_target import check_target, staged
from meshtrain.training.lora_files import save_peft
from meshtrain.training.config import DTYPES
from meshtrain.training.config_loader import tomllib


def read_family(checkpoint_dir: str | Path) -> str:
    """[model] name of the run that wrote the checkpoint (its job_config.toml); llama for
    a checkpoint without one."""
    path = Path(checkpoint_dir) / "job_config.toml"
    if not path.is_file():
        return "llama"
    try:
        return tomllib.loads(path.read_text()).get("model", {}).get("name", "llama")
    except (ValueError, UnicodeDecodeError) as err:  # TOMLDecodeError is a ValueError
        raise ValueError(f"{path} is not TOML ({err}): the checkpoint is damaged") from None


def read_model_config(checkpoint_dir: str | Path):
    """The model's config dataclass, of the family that wrote the checkpoint."""
    path = Path(checkpoint_dir) / "model_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the checkpoint does not say which model it holds")
    family = read_family(checkpoint_dir)
    if family not in registry.FAMILIES:
        raise ValueError(f"{path}: unknown model family {family!r}; known: {', '.join(registry.FAMILIES)}")
    cls = registry.get(family).config_class()
    try:
        fields = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err}): the checkpoint is damaged") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} holds a {type(fields).__name__}, not the model's config: the checkpoint is damaged")
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(fields) - known):
        raise ValueError(f"{path}: unknown {cls.__name__} fields {', '.join(unknown)}")
    if fields.get("rope_scaling") is not None:  # a tuple in the dataclass, a list in JSON
        fields["rope_scaling"] = tuple(fields["rope_scaling"])
    return cls(**fields)


def _order(name: str):
    """Embeddings, layers in numeric order (not "10" before "2"), norm, output."""
    match = re.match(r"layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return ({"tok_embeddings.weight": 0, "norm.weight": 2, "output.weight": 3}.get(name, 4), 0, name)


def model_tensors(checkpoint_dir: str | Path, dtype: torch.dtype | None = None,
                  select=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter name, full tensor) for each model weight in a DCP folder, one at a time;
    ``select(name)``: only those."""
    reader = SafeReader(str(checkpoint_dir))
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"{checkpoint_dir} is not a torch.distributed.checkpoint folder "
                                "(no .metadata)") from None
    entries = {key: meta for key, meta in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not entries:
        raise ValueError(f"{checkpoint_dir} holds no model weights (no 'model.*' tensors)")
    names = {canonical_name(key.removeprefix("model.")): key for key in entries}
    names = {name: key for name, key in names.items() if select is None or select(name)}
    for name in sorted(names, key=_order):
        key = names[name]
        meta = entries[key]
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # "no process group: loading in one process" is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: tensor}, storage_reader=reader, no_dist=True)
        yield name, tensor if dtype is None else tensor.to(dtype)


def read_lora(checkpoint_dir: str | Path) -> dict:
    """The [lora] section of the run that wrote the checkpoint ({} when it had none)."""
    path = Path(checkpoint_dir) / "job_config.toml"
    return tomllib.loads(path.read_text()).get("lora", {}) if path.is_file() else {}


def has_adapters(checkpoint_dir: str | Path) -> bool:
    metadata = SafeReader(str(checkpoint_dir)).read_metadata()
    return any(key.startswith("model.") and is_adapter(key) for key in metadata.state_dict_metadata)


def merged_tensors(checkpoint_dir: str | Path, dtype: torch.dtype | None, scaling: float):
    """The base weights with each adapter folded in, W + scaling * B A (in float32, then
    ``dtype``): the model the adapted one computes, with no adapters left."""
    adapters = dict(model_tensors(checkpoint_dir, select=is_adapter))
    for name, tensor in model_tensors(checkpoint_dir, select=lambda n: not is_adapter(n)):
        stem = name.removesuffix(".weight")
        a, b = adapters.get(f"{stem}.lora_A.{ADAPTER}.weight"), adapters.get(f"{stem}.lora_B.{ADAPTER}.weight")
        if a is not None:
            tensor = (tensor.float() + scaling * (b.float() @ a.float())).to(tensor.dtype)
        yield name, tensor if dtype is None else tensor.to(dtype)


def export(checkpoint_dir: str | Path, out: str | Path, fmt: str, dtype: torch.dtype | None = None,
           merge_lora: bool = False) -> None:
    """Write the checkpoint's model to ``out``; an earlier export there is replaced only once
    the new one is complete (training/export_target.py). A checkpoint of a [lora] run
    exports as a PEFT folder (``fmt`` "peft": the adapters alone), or with ``merge_lora``
    as the merged model."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint folder {checkpoint_dir} " + (
            "is a file: give a step's checkpoint folder, e.g. outputs/RUN/checkpoint/step-00000100"
            if checkpoint_dir.exists() else "does not exist"))
    steps = sorted((p for p in checkpoint_dir.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    if steps and not (checkpoint_dir / "model_config.json").exists():
        raise FileNotFoundError(
            f"{checkpoint_dir} is a run's checkpoint folder, not one step's; export a step folder, "
            f"e.g. {steps[-1]} (steps saved: {', '.join(str(int(p.name[5:])) for p in steps)})")
    cfg = read_model_config(checkpoint_dir)
    family = registry.get(read_family(checkpoint_dir))
    if fmt == "hf" and not family.hf:
        raise ValueError(f"{checkpoint_dir} holds a {family.name} model, which has no Hugging Face "
                         "converter (models/registry.py); Hugging Face export is for Llama. Use --format torch")
    if fmt == "peft" and family.name != "hf":
        raise ValueError(f"{checkpoint_dir} holds a {family.name} model, whose module names are not "
                         "transformers' ones a PEFT folder is keyed by; --format peft is for [model] name = \"hf\". "
                         "Use --format hf --merge-lora, or --format torch")
    check_target(out, fmt)
    if not (checkpoint_dir / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a torch.distributed.checkpoint folder (no .metadata)")
    # Sizes only, no tensor read: a truncated or missing shard is named before anything is written.
    problem = tensor_damage(checkpoint_dir)
    if problem:
        raise ValueError(f"{checkpoint_dir} is damaged ({problem}); export another step, e.g. an earlier one")
    adapted, lora = has_adapters(checkpoint_dir), read_lora(checkpoint_dir)
    if (fmt == "peft" or merge_lora) and not adapted:
        raise ValueError(f"{checkpoint_dir} holds no LoRA adapters (it was not trained with [lora] enable = "
                         f"true): export it with --format hf{'' if fmt == 'peft' else ' without --merge-lora'}")
    if fmt == "hf" and adapted and not merge_lora:
        raise ValueError(f"{checkpoint_dir} holds LoRA adapters, which a Hugging Face model folder has no "
                         "place for: add --merge-lora (the adapters folded into the weights), or export them "
                         "with --format peft")
    if merge_lora:
        tensors = merged_tensors(checkpoint_dir, dtype, lora["alpha"] / lora["rank"])
    else:
        tensors = model_tensors(checkpoint_dir, dtype)
    with staged(out, fmt) as tmp:
        if fmt == "peft":
            base = tomllib.loads((checkpoint_dir / "job_config.toml").read_text())
            save_peft(tensors, tmp, rank=lora["rank"], alpha=lora["alpha"], dropout=lora.get("dropout", 0.0),
                      base_model=base.get("checkpoint", {}).get("initial_load_hf", ""))
        elif fmt == "hf":
            family.hf_module().save_hf(tensors, cfg, tmp)
        else:
            state = dict(tensors)
            with torch.device("meta"):  # only to ask which names are one weight
                ties = family.model_class()(cfg).tied_weights()
            for names in ties:
                # One tensor under every name (stored once), as the model's state_dict has it.
                for name in names[1:]:
                    state[name] = state[names[0]]
            torch.save(state, tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshtrain export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="a DCP checkpoint folder (one step's)")
    parser.add_argument("out", help="format hf and peft: output folder; format torch: output file")
    parser.add_argument("--format", choices=("hf", "torch", "peft"), required=True,
                        help="peft: a [lora] run's adapters as a folder PeftModel.from_pretrained loads")
    parser.add_argument("--dtype", choices=DTYPES, help="convert weights (default: as stored)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="a [lora] run: fold the adapters into the weights (W + alpha/rank * B A)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        export(args.checkpoint_dir, args.out, args.format, getattr(torch, args.dtype) if args.dtype else None,
               merge_lora=args.merge_lora)
    except (FileNotFoundError, ValueError, ImportError) as err:  # ImportError: no safetensors
        print(f"meshtrain: error: {err}", file=sys.stderr, flush=True)
        return 2
    except CheckpointException as err:  # DCP could not read a shard the size check passed
        print(f"meshtrain: error: reading {args.checkpoint_dir} failed, a shard is damaged ({root_cause(err)}); "
              f"nothing at {args.out} was changed. Export another step, e.g. an earlier one", file=sys.stderr,
              flush=True)
        return 2
    out = Path(args.out)
    size = sum(f.stat().st_size for f in (out.rglob("*") if out.is_dir() else [out]) if f.is_file())
    print(f"meshtrain: exported {args.checkpoint_dir} to {out} ({args.format}, {size / 2**20:,.1f} MiB) "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
