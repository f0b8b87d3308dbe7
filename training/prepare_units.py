"""The units of work of training/prepare_data.py: what they are, and tokenizing one.

A unit is a piece of input that one worker tokenizes on its own: a whole text file (one
document; cutting it would change how a BPE tokenizer splits it at the cut), a chunk of
about CHUNK_BYTES of a .jsonl file cut at a line break (one document per line), or one row
group of a .parquet file (one document per row). The units of a corpus depend only on
the input files, never on the number of workers, so neither does the output.

A unit's output is its documents' tokens, each document preceded by EOS (`--kind sft`:
its records' tokens, loss mask and lengths, `tokenize_sft_unit`). The writer drops
the very first token of the whole stream, which leaves documents joined by EOS exactly as
``training.data.load_tokens`` joins them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from meshtrain.training import sft
from meshtrain.training.config import ConfigError
from meshtrain.training.data import (MAX_UNDECODABLE, TEXT_SUFFIXES, HFTokenizer, JsonlError, _sorted_files, build_tokenizer,
                                     check_not_foreign_encoding, decode_utf8, jsonl_documents)

CHUNK_BYTES = 8 << 20  # big enough to amortize a task, small enough to spread a big file over workers
PARQUET = ".parquet"


class Unit(NamedTuple):
    kind: str      # "text", "jsonl" or "parquet"
    path: str
    start: int     # text, jsonl: byte offset; parquet: row group
    end: int       # text, jsonl: byte offset past the end; parquet: first row of the group
    nbytes: int    # for the progress line


def _pyarrow_parquet(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading parquet needs pyarrow: pip install pyarrow "
                          f"(or pip install meshtrain[data])") from None
    return pq


def input_files(inputs: list[str]) -> list[Path]:
    """Named files as they are; folders walked for text, jsonl and parquet files, sorted."""
    files = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            files += _sorted_files(path, TEXT_SUFFIXES + (PARQUET,))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"input '{name}' does not exist")
    if not files:
        raise ConfigError(f"no {'/'.join(TEXT_SUFFIXES + (PARQUET,))} files in {', '.join(inputs)}")
    return files


def plan_units(files: list[Path], text_key: str) -> list[Unit]:
    units = []
    for path in files:
        size = path.stat().st_size
        if path.suffix != PARQUET:
            with open(path, "rb") as f:
                check_not_foreign_encoding(path, f.read(4))
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                start = 0
                while start < size:  # cut after the first line break at or past each CHUNK_BYTES
                    f.seek(min(start + CHUNK_BYTES, size))
                    f.readline()
                    end = min(f.tell(), size)
                    units.append(Unit("jsonl", str(path), start, end, end - start))
                    start = end
        elif path.suffix == PARQUET:
            meta = _pyarrow_parquet(path).ParquetFile(path).metadata
            if text_key is not None and text_key not in meta.schema.names:  # None: the caller checks
                raise ConfigError(f"{path}: no column '{text_key}' (columns: {', '.join(meta.schema.names)}); "
                                  f"name the text column with --text-key")
            row = 0
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                units.append(Unit("parquet", str(path), g, row, group.total_byte_size))
                row += group.num_rows
        else:
            units.append(Unit("text", str(path), 0, size, size))
    return units


def _jsonl_documents(unit: Unit, text: str, text_key: str) -> list[str]:
    try:
        return jsonl_documents(text, text_key)
    except JsonlError as e:
        with open(unit.path, "rb") as f:  # only now count the lines before this chunk
            before = f.read(unit.start).count(b"\n")
        raise ConfigError(f"{unit.path}:{before + e.index + 1}: {e.problem}") from None


def _parquet_documents(unit: Unit, text_key: str) -> list[str]:
    table = _pyarrow_parquet(unit.path).ParquetFile(unit.path).read_row_group(unit.start, columns=[text_key])
    docs = table.column(text_key).to_pylist()
    for i, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise ConfigError(f"{unit.path}: row {unit.end + i} (from 0): column '{text_key}' is "
                              f"{'null' if doc is None else type(doc).__name__}, not a string")
    return docs


def tokenize_unit(unit: Unit, spec: str, text_key: str, dtype: str, threads: bool = True):
    """(tokens, documents, undecodable bytes, characters, NUL characters) of one unit.
    ``threads=False`` in worker processes: each worker is already one of the cores."""
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    bad = chars = nuls = 0
    if unit.kind == "parquet":
        docs = _parquet_documents(unit, text_key)
    else:
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            # A chunk ends at a line break, never inside a UTF-8 sequence: decoding chunks
            # one by one gives the same text as decoding the file.
            text, bad = decode_utf8(f.read(unit.end - unit.start))
        chars, nuls = len(text), text.count("\x00")
        if nuls > MAX_UNDECODABLE * max(chars, 1):  # before a jsonl parser would call it bad JSON
            check_decodable(unit.path, bad, chars, nuls)
        docs = [text] if unit.kind == "text" else _jsonl_documents(unit, text, text_key)
    tok = build_tokenizer(spec)
    if isinstance(tok, HFTokenizer):  # the batch call, without special tokens, as tok.encode
        ids = [e.ids for e in tok.tok.encode_batch(docs, add_special_tokens=False)]
    else:  # the bytes of each document, as ByteTokenizer.encode
        ids = [np.frombuffer(d.encode("utf-8", "replace"), dtype=np.uint8) for d in docs]
    out = np.empty(sum(len(i) for i in ids) + len(ids), dtype=dtype)
    at = 0
    for doc in ids:
        out[at] = tok.eos_id
        out[at + 1:at + 1 + len(doc)] = doc
        at += 1 + len(doc)
    return out, len(docs), bad, chars, nuls


def tokenize_sft_unit(unit: Unit, spec: str, template: str, dtype: str, threads: bool = True):
    """(tokens, mask, lengths) of one unit's instruction records (training/sft.py): a chunk
    of a .jsonl file, or a row group of a .parquet file."""
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if unit.kind == "parquet":
        records = sft.parquet_records(unit.path, unit.start, unit.end)
    elif unit.kind == "jsonl":
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            text = f.read(unit.end - unit.start).decode("utf-8", "replace")

        def lines_before() -> int:  # only for a message: the lines of the file before this chunk
            with open(unit.path, "rb") as f:
                return f.read(unit.start).count(b"\n")
        records = sft.jsonl_records(text, unit.path, lines_before)
    else:
        raise ConfigError(f"{unit.path}: --kind sft reads .jsonl and .parquet records, not text files")
    return sft.encode_records(records, build_tokenizer(spec), template, spec, dtype)


def check_decodable(path: str, bad: int, chars: int, nuls: int = 0) -> str | None:
    """The refusal (as training.data._read_text), or a note on a few replaced bytes, for one
    file from the counts of all its units."""
    if nuls > MAX_UNDECODABLE * max(chars, 1):  # text has none; UTF-16/32 read as UTF-8 is full of them
        raise ConfigError(f"{path}: {nuls:,} of its {chars:,} characters are NUL bytes: it is not UTF-8 text "
                          f"(UTF-16 or UTF-32 without a byte-order mark, or binary). Convert it to UTF-8, e.g. "
                          f"`iconv -f UTF-16LE -t UTF-8`, or remove it from the inputs")
    if bad > MAX_UNDECODABLE * max(chars, 1):
        raise ConfigError(f"{path}: {bad:,} bytes are not UTF-8 text; it looks binary. Remove it "
                          f"from the inputs (text files: {'/'.join(TEXT_SUFFIXES)}, or {PARQUET})")
    return f"{path}: {bad} bytes are not UTF-8 and were replaced" if bad else None
