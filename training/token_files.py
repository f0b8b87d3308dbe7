"""The "tokens" dataset: a corpus tokenized ahead of time (meshtrain prepare-data)
and read from memory-mapped files, so no rank ever tokenizes or holds the whole corpus.

A prepared folder holds shard_00000.bin, shard_00001.bin, ... -- the token stream, flat,
uint16 when the vocabulary fits in 16 bits and uint32 otherwise -- and index.json, which
says what the shards are (see docs/data.md). The shards concatenated are the same stream
``load_tokens`` builds in memory: documents joined by EOS. Windows are cut from that
concatenated stream exactly as for the in-memory datasets, so a window may run across a
shard boundary; it is read in two pieces. That keeps every token of the corpus usable and
makes the windows independent of how the corpus was cut into shards.

Start-up reads index.json and stats the shards (sizes only); it never reads the tokens.
The loader reads the windows of the batches it is asked for, nothing else. What it does
check, cheaply: the tokenizer is the one the folder was prepared with (`tokenizer_id`);
a shard's sampled blocks match the hash recorded at prepare time, when the shard is first
opened (`sample_sha256`, 64 KiB read); every window's ids are below the vocabulary (a
shard replaced by other bytes of the same size would otherwise end in an IndexError
inside the embedding).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from pathlib import Path

import numpy as np
import torch

from meshtrain.training.config import ConfigError
from meshtrain.training.loader import DataLoader
from meshtrain.training.shuffle import permute, round_keys

FORMAT, VERSION = "meshtrain-tokens", 2  # 2: tokenizer_id, each shard's sample_sha256 and max_id
INDEX = "index.json"
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096  # what sample_sha256 reads of a shard: 64 KiB, spread evenly


class DataDamage(ConfigError):
    """A prepared file found damaged while training (a shard replaced or corrupted after the
    start-up checks). Only the rank that read it knows: that rank says so (train.run)."""

    every_rank = True


def tokenizer_id(spec: str) -> str:
    """What identifies a tokenizer, whatever path it was given by: "byte", or the sha256 of
    the tokenizer.json file."""
    if spec == "byte":
        return "byte"
    h = hashlib.sha256()
    with open(spec, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return "sha256:" + h.hexdigest()


def sample_sha256(data) -> str:
    """sha256 of the size and SAMPLE_BLOCKS evenly spaced blocks of ``data`` (bytes-like):
    a replaced or rewritten shard is found without reading it all."""
    view = memoryview(data).cast("B")
    n, h = len(view), hashlib.sha256()
    h.update(n.to_bytes(8, "little"))
    for k in range(SAMPLE_BLOCKS):
        at = (n - SAMPLE_BYTES) * k // max(SAMPLE_BLOCKS - 1, 1) if n > SAMPLE_BYTES else 0
        h.update(view[at:at + SAMPLE_BYTES])
    return h.hexdigest()


def prepare_again(folder) -> str:
    return (f"prepare the folder again (`meshtrain prepare-data INPUT... --out {folder} --overwrite`); "
            f"`meshtrain prepare-data --verify {folder}` checks every byte")


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def index_checksum(index: dict) -> str:
    """sha256 of the index without its own checksum: covers the tokenizer, vocabulary, and
    every shard's size and sha256, so it names the dataset's content in a few bytes."""
    body = {k: v for k, v in index.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class TokenFiles:
    """The shards of a prepared folder as one read-only token sequence."""

    def __init__(self, folder: str, key: str = "[training] dataset_path"):
        self.folder = Path(folder)
        path = self.folder / INDEX
        where = f'{key} = "{folder}"'
        if not path.is_file():
            raise ConfigError(f"{where}: no {path}; prepare the folder with "
                              f"`meshtrain prepare-data INPUT... --out {folder}`")
        try:
            index = json.loads(path.read_text())
            shards = index["shards"]
            self.dtype = np.dtype(index["dtype"])
            self.vocab_size, self.eos_id = int(index["vocab_size"]), int(index["eos_id"])
            self.num_tokens, self.checksum = int(index["num_tokens"]), index["checksum"]
            self.tokenizer = index["tokenizer"]
            fmt, version = index.get("format"), index.get("version")
            if (fmt, version) == (FORMAT, VERSION):
                self.tokenizer_id = index["tokenizer_id"]
                self.samples = [s["sample_sha256"] for s in shards]
                self.max_ids = [int(s["max_id"]) for s in shards]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{where}: {path} is not a meshtrain token index ({err!r})") from None
        if fmt == FORMAT and isinstance(version, int) and version < VERSION:
            raise ConfigError(f"{where}: {path} was written by an earlier meshtrain (index version {version}), "
                              f"which did not record the tokenizer's identity nor the shards' checksums; "
                              f"{prepare_again(folder)}")
        if (fmt, version) != (FORMAT, VERSION):
            raise ConfigError(f"{where}: {path} is not a {FORMAT} version {VERSION} index")
        if index_checksum(index) != self.checksum or sum(s["tokens"] for s in shards) != self.num_tokens:
            raise ConfigError(f"{where}: {path} is inconsistent (its checksum or token count does not "
                              f"match its contents); prepare the folder again")
        if max(self.max_ids, default=0) >= self.vocab_size:
            raise ConfigError(f"{where}: {path} records token ids up to {max(self.max_ids)}, beyond its "
                              f"vocabulary of {self.vocab_size}; {prepare_again(folder)}")
        # Sizes, not contents: a stat per shard, however big the corpus. A full check of
        # every byte is `meshtrain prepare-data --verify FOLDER`.
        self.paths = [self.folder / s["file"] for s in shards]
        for shard, p in zip(shards, self.paths):
            want = shard["tokens"] * self.dtype.itemsize
            size = p.stat().st_size if p.is_file() else None
            if size != want:
                found = "missing" if size is None else f"{size:,} bytes"
                raise ConfigError(f"{where}: shard {p} is {found}, but {path} says "
                                  f"{want:,} bytes (truncated or replaced?); prepare the folder again")
        sizes = np.array([s["tokens"] for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # token offset of each shard
        self.first = 0  # the sequence is tokens [first, num_tokens) of the stream (a held-out split cuts it)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_tokens - self.first

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:  # opened on first use: start-up does not grow with the shard count
            with open(self.paths[i], "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            # Windows are read in random order, a few KB each: on a cold cache the kernel's
            # default read-ahead would read ~128 KB from disk around each one.
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_RANDOM)
            if sample_sha256(mm) != self.samples[i]:  # 64 KiB, once per shard and process
                raise DataDamage(f"{self.paths[i]} does not match the checksum {self.folder / INDEX} recorded "
                                 f"when it was prepared (replaced or damaged since); {prepare_again(self.folder)}")
            self._maps[i] = np.frombuffer(mm, dtype=self.dtype)
        return self._maps[i]

    def check_ids(self, ids: np.ndarray, start: int) -> None:
        """DataDamage naming the shard if any id of the window read at ``start`` is outside
        the vocabulary the folder was prepared with (the model's is at least as large)."""
        if ids.size and int(ids.max()) >= self.vocab_size:
            at = start + self.first + int(np.argmax(ids >= self.vocab_size))
            i = int(np.searchsorted(self.starts, at, side="right")) - 1
            raise DataDamage(f"{self.paths[i]} holds token id {int(ids.max())} at token {at - int(self.starts[i]):,}, "
                             f"beyond the vocabulary of {self.vocab_size} it was prepared with (replaced or "
                             f"damaged since); {prepare_again(self.folder)}")

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the sequence, across shard boundaries if need be."""
        start += self.first
        pieces = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.starts[i])
            piece = self._shard(i)[offset:offset + length]
            pieces.append(piece)
            start, length, i = start + len(piece), length - len(piece), i + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class TokenFileLoader(DataLoader):
    """DataLoader over TokenFiles: the same windows, batches and rank slices, in a
    different order. The in-memory datasets keep ``torch.randperm`` (their order is what
    existing runs and tests were made with, and the corpus already costs more memory than
    the permutation); here the order of an epoch is a computed permutation
    (training/shuffle.py), so no rank ever holds one int per window."""

    _as_tokens = staticmethod(lambda files: files)  # keep the files; torch.as_tensor would read them

    def _window_ids(self, start: int, count: int) -> torch.Tensor:
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_windows)
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # one batch spans at most two epochs
            sel = epochs == epoch
            ids[sel] = permute(offsets[sel], self.num_windows, round_keys(self.seed, int(epoch)))
        return torch.from_numpy(ids)

    def _windows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.seq_len + 1
        w = np.stack([self.tokens.read(int(i) * width, width) for i in ids])
        if w.size and int(w.max()) >= self.tokens.vocab_size:  # one max per batch; the search only on failure
            for i, row in zip(ids, w):
                self.tokens.check_ids(row, int(i) * width)
        w = w.astype(np.int64)
        w = torch.from_numpy(w)
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "dataset_checksum": self.tokens.checksum}

    def load_state_dict(self, sd: dict) -> None:
        # The window count alone would not notice a corpus edited to the same length.
        if sd.get("dataset_checksum") != self.tokens.checksum:
            raise ConfigError(f"data loader state was saved with another dataset (index checksum "
                              f"{sd.get('dataset_checksum')}) than {self.tokens.folder / INDEX} "
                              f"({self.tokens.checksum}); resuming would read different sequences")
        super().load_state_dict(sd)


def build_token_loader(cfg, tokenizer, *, local: int, dp_rank: int, dp_size: int, span=None) -> TokenFileLoader:
    """``span(num_tokens) -> (start, stop)``: read only those tokens of the stream (a
    held-out split, training/data.py `held_out_range`); None: all of them."""
    files = TokenFiles(cfg.dataset_path)
    check_tokenizer(files.folder / INDEX, files.tokenizer, files.tokenizer_id, cfg.tokenizer)
    max_tokens = getattr(cfg, "max_tokens", None)
    if max_tokens is not None:
        files.num_tokens = min(files.num_tokens, max_tokens)
    if span is not None:
        files.first, files.num_tokens = span(files.num_tokens)
    return TokenFileLoader(files, seq_len=cfg.seq_len, global_batch_size=cfg.global_batch_size,
                           local_batch_size=local, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed,
                           eos_id=files.eos_id if getattr(cfg, "document_masking", False) else None)


def check_tokenizer(index_path: Path, prepared: str, prepared_id: str, spec: str) -> None:
    """ConfigError naming both unless ``spec`` (the run's [training] tokenizer) is the
    tokenizer the folder was prepared with: the same ids mean other text under another one."""
    if tokenizer_id(spec) != prepared_id:
        raise ConfigError(f'[training] tokenizer = "{spec}" is not the tokenizer {index_path} was prepared with '
                          f'("{prepared}", {prepared_id[:19]}...): its token ids would mean other text. Set '
                          f"[training] tokenizer to the one the folder was prepared with, or prepare the data "
                          f"again with this one")
