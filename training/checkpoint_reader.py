"""Read a DCP checkpoint that someone else may have written, without running code from it.

A DCP checkpoint is `.metadata` (a pickled index of every tensor's shards) plus `.distcp`
files of tensors. torch reads the tensors with ``torch.load(weights_only=True)``, but it
reads `.metadata` with plain ``pickle.load``, and an entry the index marks as bytes with
``torch.load(weights_only=False)``: either would run whatever a crafted file asks for.
`SafeReader` unpickles the index with an allowlist of exactly the classes DCP builds it
from, refuses anything else before it is constructed, and refuses byte entries (meshtrain
writes tensors only). Every DCP read of meshtrain goes through it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

# (module, name) pairs a DCP index is made of (torch 2.11 to 2.13): its dataclasses, the
# shard locations, shapes, dtypes, layouts and memory formats, and the path it was saved at.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # layout by name, from a fixed table
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks for something a plain DCP checkpoint never contains."""


class DamagedCheckpointError(ValueError):
    """An index that cannot be read (truncated, not a pickle): the folder is damaged, not crafted."""


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refused to load {module}.{name}, which is not part of a DCP checkpoint's "
            f"index; the file may have been crafted to run code. Nothing from it was run.")


def read_index(path: str, stream) -> Metadata:
    """Unpickle a `.metadata` stream with the allowlist and check what it describes."""
    try:
        metadata = _IndexUnpickler(stream, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or not a pickle at all
        raise DamagedCheckpointError(f"{path}: not a readable DCP index ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not a DCP index")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{path}: entry '{key}' is stored as pickled bytes, which loading would unpickle; "
                f"meshtrain checkpoints hold tensors only")
    return metadata


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose index is read once, through `read_index`."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:  # dcp.load asks on every call; export calls it per tensor
            path = self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(path, "rb") as stream:
                metadata = read_index(str(path), stream)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata


def damage(path) -> str | None:
    """What is wrong with a checkpoint folder, in words, or None when it is intact: every
    file the index names is there and long enough, and meta.json and model_config.json are
    readable with what resume needs. Cheap (sizes only, no tensor is read), so resume can
    check before it loads and fall back past a damaged checkpoint. An index that asks for
    code is not damage: `read_index` refuses it (UnsafeCheckpointError)."""
    return tensor_damage(path) or _side_file_damage(path)


def tensor_damage(path) -> str | None:
    """What is wrong with a checkpoint folder's tensors (its DCP index and the shards the
    index names), or None: what export needs, which reads no meta.json."""
    path = Path(path)
    index = path / ".metadata"
    if not index.is_file():
        return "no DCP index (.metadata): the save did not finish"
    with open(index, "rb") as stream:
        try:
            metadata = read_index(str(index), stream)
        except DamagedCheckpointError as err:
            return str(err)
    sizes = {}
    for item in (metadata.storage_data or {}).values():
        end = item.offset + item.length
        sizes[item.relative_path] = max(sizes.get(item.relative_path, 0), end)
    for name, needed in sorted(sizes.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {shard} is missing"
        if shard.stat().st_size < needed:
            return f"shard {shard} is truncated ({shard.stat().st_size:,} of at least {needed:,} bytes)"
    return None


def _side_file_damage(path) -> str | None:
    path = Path(path)
    for name, keys in (("meta.json", ("step", "dataloader", "lr_scheduler")), ("model_config.json", ())):
        try:
            data = json.loads((path / name).read_text())
        except FileNotFoundError:
            return f"{path / name} is missing"
        except (ValueError, UnicodeDecodeError) as err:
            return f"{path / name} is not JSON ({err})"
        missing = [k for k in keys if not isinstance(data, dict) or k not in data]
        if missing or not isinstance(data, dict):
            return f"{path / name} lacks {', '.join(missing) or 'its fields'}"
    return None
