"""Hugging Face weight folders, for any family: find which safetensors file holds each
tensor, read one rank's block of a tensor, and write tensors as (sharded) safetensors."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshtrain.parallel.init import canonical_name
from meshtrain.parallel.lora import is_adapter


def tensor_files(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (model.safetensors, or an index's).
    Every file is opened once here, which reads its header and checks that the data it
    describes is all there: a truncated download or a shard the index names but the folder
    lacks is a ValueError naming the file, found before any weight is read."""
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / "model.safetensors").is_file():
        return dict.fromkeys(_names_in(hf_dir / "model.safetensors"), hf_dir / "model.safetensors")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {k: hf_dir / f for k, f in weight_map.items()}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index (a JSON object whose \"weight_map\" maps each "
                             f"tensor to its file): {type(err).__name__}: {err}") from None
        root = hf_dir.resolve()
        outside = sorted({str(f) for f in files.values() if root not in f.resolve().parents})
        if outside:  # an index may only point at shards beside it
            raise ValueError(f"{index} names files outside {hf_dir}: {', '.join(outside[:3])}")
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ValueError(f"{index} puts {sum(f == shard for f in files.values())} tensors in "
                                 f"{shard.name}, which is missing from {hf_dir}; download it again")
            absent = sorted(k for k, f in files.items() if f == shard and k not in _names_in(shard))
            if absent:
                raise ValueError(f"{index} puts {absent[0]} in {shard.name}, which does not hold it "
                                 f"({len(absent)} such tensors): the index and the shards are of different downloads")
        return files
    pickled = sorted(p.name for p in hf_dir.glob("pytorch_model*.bin"))
    if pickled:
        raise FileNotFoundError(
            f"{hf_dir} holds only {', '.join(pickled)}: pickled weights, which can run code when loaded, so "
            "meshtrain reads safetensors only. Convert once where you trust the file: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) writes safetensors")
    raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")


def _names_in(path: Path) -> set[str]:
    """The tensor names a safetensors file holds; ValueError naming the file when it cannot
    be read (safetensors checks on opening that the header is whole and that the data it
    describes fits the file, so a truncated file is found here)."""
    try:
        with safe_open(path, framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}); it may be truncated: "
                         f"download it again") from None


@torch.no_grad()
def fill_from_safetensors_(model: torch.nn.Module, hf_dir: Path, stored_name: Callable[[str, dict], str],
                           read_block: Callable | None = None, *, adapters: bool = False,
                           files: dict[str, Path] | None = None, assembled: Callable | None = None) -> None:
    """Fill every parameter of ``model`` (plain, a pipeline stage, or sharded with any
    placements) from the safetensors in ``hf_dir``. ``stored_name(our name, files)`` is
    the tensor's name there; ``read_block(source, shape, offset, our name)`` reads this
    rank's block of it (default: the block as stored). Each rank reads only its own block
    of each tensor, so peak extra memory is about one local shard. ``adapters``: fill the
    LoRA adapters (from ``files``, a PEFT folder's) instead of the model's own weights,
    which a model's folder holds and a PEFT folder does not. ``assembled(stored name, files,
    get_slice)``: for a name the folder does not hold, an object answering as a slice does
    (get_shape, [slices]) built from the tensors it does hold, or None."""
    files = files if files is not None else tensor_files(hf_dir)
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}  # safetensors maps each file; a slice reads only its bytes
        for name, param in model.named_parameters():
            name = canonical_name(name)
            if is_adapter(name) != adapters:
                continue
            stored = stored_name(name, files)

            def get_slice(stored):
                try:  # tensor_files checked every file; this one may have changed since
                    if files[stored] not in opened:
                        opened[files[stored]] = stack.enter_context(safe_open(files[stored], framework="pt"))
                    return opened[files[stored]].get_slice(stored)
                except (SafetensorError, OSError) as err:
                    raise ValueError(f"{files[stored]}: cannot read {stored} ({err})") from None

            source = get_slice(stored) if stored in files else assembled(stored, files, get_slice) if assembled else None
            if source is None:
                raise ValueError(f"{stored} (the model's {name}) is missing from the weights in {hf_dir}")
            if tuple(source.get_shape()) != tuple(param.shape):
                raise ValueError(f"{stored} has shape {tuple(source.get_shape())} in the checkpoint, "
                                 f"but the model's {name} is {tuple(param.shape)} (checkpoint: {hf_dir})")
            local = param.to_local() if isinstance(param, DTensor) else param
            shape, offset = tuple(param.shape), (0,) * param.dim()
            if isinstance(param, DTensor):  # the block this rank owns, as in parallel.init
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                      param.placements)
            if tuple(shape) != tuple(local.shape):
                raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the block "
                                   f"{tuple(shape)} its placements describe")
            if local.numel():  # else an FSDP rank past the end of a short dimension
                block = (read_block(source, shape, offset, name) if read_block else
                         source[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
                local.copy_(block)


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, *, expected: set[str],
                      max_shard_bytes: int = 5 * 10**9) -> tuple[list[Path], torch.dtype | None]:
    """Write (Hugging Face name, tensor) pairs into ``out`` as model.safetensors, or as
    model-0000i-of-0000N.safetensors + index once past ``max_shard_bytes`` (at most one
    shard is held in memory). ``expected``: the names a whole model has; a missing one is
    an error and nothing is left behind. Returns the files and the dtype written."""
    out.mkdir(parents=True, exist_ok=True)
    # A stale model.safetensors would win over a new index in from_pretrained.
    for old in [*out.glob("model-*-of-*.safetensors"), *out.glob("model.safetensors*")]:
        old.unlink()
    expected = set(expected)
    shard: dict[str, torch.Tensor] = {}
    parts: list[tuple[Path, list[str]]] = []  # (file written, its tensor names)
    total = shard_bytes = 0
    dtype = None

    def flush():
        path = out / f"model-{len(parts) + 1:05d}.partial"  # renamed once the count is known
        save_file(shard, str(path), metadata={"format": "pt"})  # "pt": transformers checks it
        parts.append((path, list(shard)))
        shard.clear()

    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        dtype = dtype or t.dtype
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = t
        expected.discard(name)
        total += nbytes
        shard_bytes += nbytes
    if expected:
        for path, _ in parts:
            path.unlink()
        raise ValueError(f"{len(expected)} tensors missing for a full model, e.g. {sorted(expected)[:3]}")
    flush()

    if len(parts) == 1:
        names = [out / "model.safetensors"]
    else:
        names = [out / f"model-{i:05d}-of-{len(parts):05d}.safetensors" for i in range(1, len(parts) + 1)]
        weight_map = {t: final.name for final, (_, keys) in zip(names, parts) for t in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for final, (path, _) in zip(names, parts):
        path.replace(final)
    return names, dtype
