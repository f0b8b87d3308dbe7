"""Tokenizers, a text corpus, and the data loader a config asks for.

The corpus is tokenized once into one 1-D token stream (documents joined by EOS); the
loader (training/loader.py) cuts it into windows and batches them the same way for every
layout, so dp=4 x local 2, dp=2 x 4 steps of gradient accumulation and dp=1 x local 8 all
train on the same sequences, and the loss curves of different layouts can be compared
step for step. Every rank builds the same stream deterministically; the data path never
communicates. Corpora too big to tokenize at every start-up are prepared once into token
files and memory-mapped instead: training/prepare_data.py and training/token_files.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch

from meshtrain.training.config import ConfigError
from meshtrain.training.loader import DataLoader
from meshtrain.training.sft_files import build_sft_loader
from meshtrain.training.token_files import build_token_loader


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, works on any text."""

    bos_id, eos_id, vocab_size = 256, 257, 258

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8", "replace")
        if not data:  # torch.frombuffer rejects an empty buffer
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")  # specials drop out


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (needs the optional ``tokenizers`` package).

    Special tokens are never added by ``encode``: the corpus builder places the
    document separator itself. The separator is the first of these the vocabulary
    has: ``<|end_of_text|>`` (Llama 3), ``</s>`` (Llama 2, Mistral), ``<|endoftext|>``
    (GPT-2 style). A vocabulary with none of them gets vocab_size - 1, which is only
    an arbitrary but stable choice; such a tokenizer should be given a real EOS.
    """

    EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>")
    BOS_CANDIDATES = ("<|begin_of_text|>", "<s>")

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"tokenizer '{path}' needs the Hugging Face tokenizers package: "
                              "pip install tokenizers (or pip install meshtrain[hf])") from e
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as err:  # the library raises a bare Exception for a file it cannot parse
            raise ConfigError(f"tokenizer '{path}' is not a Hugging Face tokenizer.json: {err}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._first_id(self.EOS_CANDIDATES, self.vocab_size - 1)
        self.bos_id = self._first_id(self.BOS_CANDIDATES, None)

    def _first_id(self, names, default):
        ids = [self.tok.token_to_id(n) for n in names]
        return next((i for i in ids if i is not None), default)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok.encode(text, add_special_tokens=False).ids, dtype=torch.int32)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tok.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """"byte", or the path of a Hugging Face tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise ConfigError(f"tokenizer must be 'byte' or the path of a tokenizer.json file; "
                         f"no file at '{spec}'")
    return HFTokenizer(spec)


# ----------------------------------------------------------------------------- corpus

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
# The stdlib corpus is the library code itself: site-packages is whatever happens to be
# installed, the test suites are mostly fixtures and generated data, and idlelib is a
# GUI app rather than library code. Keeping only real library code keeps the corpus
# about the same everywhere (it still differs a little between Python versions, so
# every node of a multi-node job needs the same Python).
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _sorted_files(root: Path, suffixes: tuple[str, ...], skip_dirs=frozenset()) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]  # prune, don't descend
        found += [Path(dirpath, f) for f in filenames if f.endswith(suffixes)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())  # same order everywhere


# A text file with more than this fraction of bytes that are not UTF-8 is refused: it is
# most likely binary (an archive, a model file), and training on it would learn noise.
MAX_UNDECODABLE = 0.01


def decode_utf8(data: bytes) -> tuple[str, int]:
    """(the text, how many bytes were not UTF-8 and got replaced)."""
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - data.count("\ufffd".encode())  # replaced, not written as U+FFFD


# Byte-order marks of encodings that are not UTF-8 (UTF-32 first: its LE mark starts as
# UTF-16's). Read as UTF-8 such a file is NUL bytes between the characters.
FOREIGN_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"),
                (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))


def check_not_foreign_encoding(path: Path, head: bytes) -> None:
    """ConfigError naming the file and the conversion if ``head`` (its first bytes) is the
    byte-order mark of UTF-16 or UTF-32."""
    for bom, name in FOREIGN_BOMS:
        if head.startswith(bom):
            raise ConfigError(f"{path}: starts with a {name} byte-order mark: the file is {name[:6]}, not UTF-8 "
                              f"(read as UTF-8, half of it would be NUL bytes). Convert it, e.g. `iconv -f "
                              f"{name[:6]} -t UTF-8 {path} > {path.stem}.utf8{path.suffix}`, and use that")


def _read_text(path: Path) -> str:
    """The file as text; a few undecodable bytes are replaced (and counted in a warning),
    many mean the file is not text at all (ConfigError naming it)."""
    data = path.read_bytes()
    check_not_foreign_encoding(path, data[:4])
    text, bad = decode_utf8(data)
    if text.count("\x00") > MAX_UNDECODABLE * max(len(text), 1):  # UTF-16/32 without a byte-order mark
        raise ConfigError(f"{path}: {text.count(chr(0)):,} of its {len(text):,} characters are NUL bytes: it is "
                          f"not UTF-8 text (UTF-16 or UTF-32 without a byte-order mark, or binary). Convert it "
                          f"to UTF-8, e.g. `iconv -f UTF-16LE -t UTF-8`, or remove it from the dataset")
    if bad > MAX_UNDECODABLE * max(len(text), 1):
        raise ConfigError(f"{path}: {bad:,} of its {len(data):,} bytes ({bad / len(data):.0%}) are not UTF-8 "
                          f"text; it looks binary. Remove it from the dataset (text files: "
                          f"{'/'.join(TEXT_SUFFIXES)})")
    if bad:
        warnings.warn(f"{path}: {bad} bytes are not UTF-8 and were replaced", stacklevel=2)
    return text


class JsonlError(ValueError):
    """A jsonl line that is not a document: ``index`` (from 0) and ``problem``."""

    def __init__(self, index: int, problem: str):
        super().__init__(problem)
        self.index, self.problem = index, problem


def jsonl_documents(text: str, key: str = "text") -> list[str]:
    """The documents of jsonl text: the ``key`` field, a string, of each non-blank line.
    Lines end at \n only: a JSON string may hold other line separators (U+2028)."""
    docs = []
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise JsonlError(i, f"not valid JSON ({e})") from e
        if not isinstance(record, dict) or key not in record:
            raise JsonlError(i, f"jsonl record has no '{key}' field")
        if not isinstance(record[key], str):
            raise JsonlError(i, f"field '{key}' is a {type(record[key]).__name__}, not a string")
        docs.append(record[key])
    return docs


def _jsonl_texts(path: Path) -> list[str]:
    try:
        return jsonl_documents(_read_text(path))
    except JsonlError as e:
        raise ConfigError(f"{path}:{e.index + 1}: {e.problem}") from None


def iter_documents(dataset: str, dataset_path: str = "") -> Iterator[str]:
    """The documents of a corpus, in a fixed order.

    "stdlib": the .py files of this Python's standard library (no download needed).
    "text": ``dataset_path`` is a file, or a directory walked for .txt/.md/.py/.jsonl;
    a text file is one document, a .jsonl line is one document (its "text" field).
    """
    if dataset == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        for path in _sorted_files(root, (".py",), STDLIB_SKIP_DIRS):
            yield _read_text(path)
    elif dataset == "text":
        root = Path(dataset_path)
        if not dataset_path or not root.exists():
            raise ConfigError(f"dataset 'text' needs dataset_path to be a file or directory; "
                             f"got '{dataset_path}'")
        files = [root] if root.is_file() else _sorted_files(root, TEXT_SUFFIXES)
        if not files:
            raise ConfigError(f"no {'/'.join(TEXT_SUFFIXES)} files under '{dataset_path}'")
        for path in files:
            yield from _jsonl_texts(path) if path.suffix == ".jsonl" else [_read_text(path)]
    else:
        raise ConfigError(f"unknown dataset '{dataset}'; expected 'stdlib' or 'text' "
                          f"('tokens' is read by training/token_files.py, not tokenized)")


def load_tokens(dataset: str, dataset_path: str = "", tokenizer: str = "byte",
                max_tokens: int | None = None) -> torch.Tensor:
    """The whole corpus as one int32 token stream, EOS between documents.
    Cached per process: the returned tensor is shared, so treat it as read-only."""
    key_path = os.path.abspath(dataset_path) if dataset_path and dataset != "stdlib" else ""
    return _load_tokens(dataset, key_path, tokenizer, max_tokens)


@functools.lru_cache(maxsize=2)
def _load_tokens(dataset, dataset_path, tokenizer, max_tokens) -> torch.Tensor:
    tok = build_tokenizer(tokenizer)
    eos = torch.tensor([tok.eos_id], dtype=torch.int32)
    pieces, total = [], 0
    for i, text in enumerate(iter_documents(dataset, dataset_path)):
        ids = tok.encode(text)
        pieces += [eos, ids] if i else [ids]
        total += len(ids) + bool(i)
        if max_tokens is not None and total >= max_tokens:
            break  # don't tokenize what would be thrown away
    tokens = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int32)
    return tokens[:max_tokens] if max_tokens is not None else tokens


def held_out_range(n_tokens: int, held_out: float, part: str) -> tuple[int, int]:
    """Tokens [start, stop) of ``part`` of a stream of ``n_tokens``: "held_out" is its last
    ``held_out`` fraction, "train" everything before it (all of it for held_out = 0). A
    cut in token space, like nanoGPT's: it does not depend on seq_len, the batch or the
    layout, so training never reads a held-out token under any of them."""
    cut = n_tokens - math.floor(n_tokens * held_out)
    if part == "train":
        return 0, cut
    if part == "held_out":
        return cut, n_tokens
    raise ValueError(f"part must be 'train' or 'held_out', got {part!r}")


def build_dataloader(cfg_training, *, dp_rank: int, dp_size: int, held_out: float = 0.0, part: str = "train"):
    """(DataLoader, tokenizer) from a training config (seq_len, global_batch_size,
    local_batch_size, seed, dataset, dataset_path, tokenizer; optional max_tokens).
    local_batch_size 0 means global_batch_size // dp_size: no gradient accumulation.
    ``held_out``: the fraction of the corpus kept for validation ([validation] split): the
    end of its token stream (`held_out_range`), or for "sft" whole records
    (training/sft_files.py `held_out_records`); ``part`` "train" reads the rest, "held_out"
    what is kept."""
    cfg = cfg_training
    local = cfg.local_batch_size or cfg.global_batch_size // dp_size
    if cfg.global_batch_size % dp_size or local < 1:
        raise ValueError(f"global_batch_size={cfg.global_batch_size} must be a positive "
                         f"multiple of dp_size={dp_size}")
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.dataset == "tokens":  # prepared files, memory-mapped: nothing is tokenized here
        loader = build_token_loader(cfg, tokenizer, local=local, dp_rank=dp_rank, dp_size=dp_size,
                                    span=lambda n: held_out_range(n, held_out, part))
        return loader, tokenizer
    if cfg.dataset == "sft":  # records packed into sequences, labels -100 but on the responses
        return build_sft_loader(cfg, tokenizer, local=local, dp_rank=dp_rank, dp_size=dp_size, held_out=held_out,
                                part=part), tokenizer
    tokens = load_tokens(cfg.dataset, cfg.dataset_path, cfg.tokenizer, getattr(cfg, "max_tokens", None))
    start, stop = held_out_range(len(tokens), held_out, part)
    if (start, stop) != (0, len(tokens)):
        tokens = tokens[start:stop]  # a view of the cached stream: nothing is copied
    loader = DataLoader(tokens, seq_len=cfg.seq_len, global_batch_size=cfg.global_batch_size,
                        local_batch_size=local, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed,
                        eos_id=tokenizer.eos_id if getattr(cfg, "document_masking", False) else None)
    return loader, tokenizer
