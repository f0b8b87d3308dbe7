"""The "sft" dataset's records as arrays, and the loader that packs them into batches.

Records (training/sft.py) become three arrays: every record's tokens end to end, a loss
mask beside them (one byte per token), and each record's start offset. From a .jsonl /
.parquet file or folder they are built at start-up, in memory. `meshtrain prepare-data
--kind sft` (training/prepare_data.py) writes them once into a folder instead --
tokens.bin, mask.bin, offsets.bin and index.json -- which every rank memory-maps: no rank
tokenizes or holds the set, and a batch reads only its own records, as with
`dataset = "tokens"`.

The loader packs records into sequences at start-up (one pass over the offsets, 8 bytes
a record) and shuffles sequences with the computed permutation of training/shuffle.py, so
step k's global batch depends only on (seed, k, global_batch_size, seq_len) and every
layout trains on the same sequences.

[validation] split holds out whole records, never a token tail (`held_out_records`): a
fixed selection of floor(split x records) of them, spread over the whole set by a
computed permutation, so a set written file by file (one source after another) is not
validated on its last source only. The selection depends on the number of records alone
-- not the seed, seq_len, batch or layout -- so training never packs a held-out record,
and two runs with other seeds validate on the same records.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch

from meshtrain.training import chat_template, sft
from meshtrain.training.config import ConfigError
from meshtrain.training.shuffle import permute, round_keys
from meshtrain.training.token_files import (DataDamage, TokenFileLoader, check_tokenizer, prepare_again, sample_sha256,
                                            token_dtype)

FORMAT, VERSION = "meshtrain-sft", 2  # 2: tokenizer_id, max_id, each file's sample sha256
INDEX = "index.json"
FILES = {"tokens": "tokens.bin", "mask": "mask.bin", "offsets": "offsets.bin"}
# The permutation that picks held-out records: a constant, not [training] seed, so the
# validation records stay the same when the seed changes.
SPLIT_KEYS = round_keys(int.from_bytes(b"val-split", "big"), 0)


class SFTRecords:
    """Every record's tokens, loss mask and start offset (``offsets`` has one more entry:
    the end), with what they were made with."""

    def __init__(self, tokens, mask, offsets, *, vocab_size: int, pad_id: int, tokenizer: str, template: str,
                 checksum: str, source: str):
        self.tokens, self.mask, self.offsets = tokens, mask, offsets
        self.vocab_size, self.pad_id, self.tokenizer, self.template = vocab_size, pad_id, tokenizer, template
        self.checksum, self.source = checksum, source

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_records(cls, path: str, tok, tokenizer: str, template_choice: str) -> "SFTRecords":
        """The records of a .jsonl / .parquet file or folder, tokenized here (start-up) with
        ``tok``, the tokenizer ``tokenizer`` names."""
        template = chat_template.resolve(template_choice, tokenizer)
        dtype = token_dtype(tok.vocab_size)
        parts = []
        for file in sft.record_files(path):
            records = (sft.parquet_records(str(file)) if file.suffix == ".parquet" else
                       sft.jsonl_records(file.read_text(encoding="utf-8", errors="replace"), str(file)))
            parts.append(sft.encode_records(records, tok, template, tokenizer, dtype))
        if not sum(len(p[2]) for p in parts):
            raise ConfigError(f'[training] dataset = "sft": no records in "{path}"')
        tokens = np.concatenate([p[0] for p in parts])
        mask = np.concatenate([p[1] for p in parts])
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([p[2] for p in parts]))]).astype(np.int64)
        h = hashlib.sha256()
        for a in (tokens, mask, offsets):
            h.update(np.ascontiguousarray(a).tobytes())
        return cls(tokens, mask, offsets, vocab_size=tok.vocab_size, pad_id=tok.eos_id, tokenizer=tokenizer,
                   template=template, checksum=h.hexdigest(), source=path)

    @classmethod
    def from_folder(cls, folder: str) -> "SFTRecords":
        """A folder `meshtrain prepare-data --kind sft` wrote, memory-mapped."""
        path = Path(folder) / INDEX
        where = f'[training] dataset_path = "{folder}"'
        try:
            index = json.loads(path.read_text())
            fmt, version = index.get("format"), index.get("version")
            ok = (fmt, version) == (FORMAT, VERSION)
            dtype, n, t = np.dtype(index["dtype"]), int(index["num_records"]), int(index["num_tokens"])
            if ok:
                samples, max_id, _ = index["samples"], int(index["max_id"]), index["tokenizer_id"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{where}: {path} is not a meshtrain sft index ({err!r})") from None
        if fmt == FORMAT and isinstance(version, int) and version < VERSION:
            raise ConfigError(f"{where}: {path} was written by an earlier meshtrain (index version {version}), "
                              f"which did not record the tokenizer's identity nor the files' checksums; "
                              f"{prepare_again(folder).replace('prepare-data', 'prepare-data --kind sft', 1)}")
        if not ok:
            raise ConfigError(f"{where}: {path} is not a {FORMAT} version {VERSION} index; prepare it with "
                              f"`meshtrain prepare-data --kind sft`")
        if index_checksum(index) != index["checksum"]:
            raise ConfigError(f"{where}: {path} is inconsistent; prepare the folder again")
        if max_id >= index["vocab_size"]:
            raise ConfigError(f"{where}: {path} records token ids up to {max_id}, beyond its vocabulary of "
                              f"{index['vocab_size']}; prepare the folder again")
        arrays = {}
        for key, (want_dtype, count) in {"tokens": (dtype, t), "mask": (np.dtype(np.uint8), t),
                                         "offsets": (np.dtype(np.int64), n + 1)}.items():
            file = Path(folder) / FILES[key]
            size = file.stat().st_size if file.is_file() else None
            if size != count * want_dtype.itemsize:  # sizes, not contents: a stat per file
                raise ConfigError(f"{where}: {file} is {'missing' if size is None else f'{size:,} bytes'}, but "
                                  f"{path} says {count * want_dtype.itemsize:,} bytes; prepare the folder again")
            arrays[key] = _map(file, want_dtype)
            # Three files, 64 KiB each: checked at start-up (a token shard is checked when first read).
            if sample_sha256(arrays[key] if size else b"") != samples[FILES[key]]:
                raise ConfigError(f"{where}: {file} does not match the checksum {path} recorded when it was "
                                  f"prepared (replaced or damaged since); prepare the folder again")
        records = cls(arrays["tokens"], arrays["mask"], arrays["offsets"], vocab_size=index["vocab_size"],
                   pad_id=index["pad_id"], tokenizer=index["tokenizer"], template=index["chat_template"],
                   checksum=index["checksum"], source=folder)
        records.tokenizer_id = index["tokenizer_id"]
        return records


def _map(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.empty(0, dtype)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_RANDOM)  # a batch reads a few records here and there
    return np.frombuffer(mm, dtype=dtype)


def index_checksum(index: dict) -> str:
    body = {k: v for k, v in index.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def held_out_records(n: int, held_out: float, part: str) -> np.ndarray | None:
    """The ids (ascending) of the records of ``part`` among ``n``: "held_out" is floor(n x
    held_out) of them, the first positions of a fixed computed permutation of [0, n);
    "train" is every other one (None, meaning all, when nothing is held out)."""
    k = math.floor(n * held_out)
    if part == "train" and not k:
        return None
    if part not in ("train", "held_out"):
        raise ValueError(f"part must be 'train' or 'held_out', got {part!r}")
    chosen = np.zeros(n, dtype=bool)
    chosen[permute(np.arange(k, dtype=np.int64), n, SPLIT_KEYS)] = True
    return np.flatnonzero(chosen if part == "held_out" else ~chosen)


class SFTLoader(TokenFileLoader):
    """The records packed into sequences of seq_len + 1 (training/sft.py), batched like
    windows: the same computed shuffle, rank slices and micro-batches as TokenFileLoader,
    and (inputs, labels) with -100 wherever a token is not trained. ``ids``: the records
    to pack, ascending (a part of a held-out split); None: all of them."""

    _as_tokens = staticmethod(lambda records: records)

    def __init__(self, records: SFTRecords, *, ids: np.ndarray | None = None, part: str = "",
                 document_masking: bool = False, **batching):
        self.ids, self.part, self.document_masking = ids, part, document_masking
        super().__init__(records, **batching)

    def _count_windows(self) -> int:
        capacity = self.seq_len + 1
        offsets = self.tokens.offsets
        self.starts, lengths = offsets[:-1], np.diff(offsets)  # of each record packed
        if self.ids is not None:
            self.starts, lengths = self.starts[self.ids], lengths[self.ids]
        self.lengths = sft.truncate(lengths, capacity)
        self.first_record = sft.pack(self.lengths, capacity)  # of each sequence, and the end
        return len(self.first_record) - 1

    def _size_words(self) -> str:
        return (f"{len(self.lengths):,} records{self.part} of {self.tokens.source} pack into {self.num_windows:,} "
                f"sequences of seq_len + 1 = {self.seq_len + 1} tokens")

    def sequences(self, ids: torch.Tensor, *, positions: bool = False):
        """(tokens, loss mask) of packed sequences ``ids``, [len(ids), seq_len + 1] each,
        and with ``positions`` each token's position in its record as a third array."""
        r = self.tokens
        rows = [sft.sequence(r.tokens, r.mask, self.starts, self.lengths, int(self.first_record[i]),
                             int(self.first_record[i + 1]), self.seq_len + 1, r.pad_id) for i in ids.tolist()]
        return tuple(np.stack(column) for column in zip(*rows))[:3 if positions else 2]

    def global_sequences(self, step: int, *, positions: bool = False):
        """The whole global batch of ``step`` as packed sequences (tokens, mask[, positions]),
        for reference runs."""
        return self.sequences(self._window_ids(step * self.global_batch_size, self.global_batch_size),
                              positions=positions)

    def _windows(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), and with document masking the inputs' positions as a third:
        a micro-batch then is (inputs, labels, positions) (training/step.py)."""
        buf, keep, positions = self.sequences(ids, positions=True)
        inputs, labels = sft.inputs_and_labels(buf, keep)
        if inputs.size and int(inputs.max()) >= self.tokens.vocab_size:  # one max per batch
            raise DataDamage(f"{self.tokens.source}: a record holds token id {int(inputs.max())}, beyond the "
                             f"vocabulary of {self.tokens.vocab_size} it was prepared with (replaced or damaged "
                             f"since); prepare the folder again")
        out = (torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(labels))
        return out + (torch.from_numpy(np.ascontiguousarray(positions[:, :-1])),) if self.document_masking else out

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("dataset_checksum") != self.tokens.checksum:
            raise ConfigError(f"data loader state was saved with other records (checksum "
                              f"{sd.get('dataset_checksum')}) than {self.tokens.source} ({self.tokens.checksum}); "
                              f"resuming would read different sequences")
        super(TokenFileLoader, self).load_state_dict(sd)


def build_sft_loader(cfg, tokenizer, *, local: int, dp_rank: int, dp_size: int, held_out: float = 0.0,
                     part: str = "train") -> SFTLoader:
    """[training] dataset = "sft": a prepared folder (index.json) is memory-mapped, a .jsonl /
    .parquet file or folder of them is tokenized now. ``held_out``: the fraction of the
    records kept for validation ([validation] split); ``part`` "train" packs the others,
    "held_out" those (`held_out_records`)."""
    path = cfg.dataset_path
    if os.path.isfile(os.path.join(path, INDEX)):
        records = SFTRecords.from_folder(path)
        check_tokenizer(Path(path) / INDEX, records.tokenizer, records.tokenizer_id, cfg.tokenizer)
    else:
        records = SFTRecords.from_records(path, tokenizer, cfg.tokenizer, getattr(cfg, "chat_template", "auto"))
    ids = held_out_records(len(records), held_out, part)
    words = "" if ids is None else " held out for validation" if part == "held_out" else " left for training"
    return SFTLoader(records, ids=ids, part=words, seq_len=cfg.seq_len, global_batch_size=cfg.global_batch_size,
                     local_batch_size=local, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed,
                     document_masking=bool(getattr(cfg, "document_masking", False)))
