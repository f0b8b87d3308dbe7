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

import pickle

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
        raise UnsafeCheckpointError(f"{path}: not a readable DCP index ({type(err).__name__}: {err})") from None
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
