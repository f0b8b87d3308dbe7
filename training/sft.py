"""Instruction fine-tuning data: records -> tokens and a loss mask -> packed sequences.

A record is one line of a .jsonl file (or one row of a .parquet file), either

    {"prompt": "What is 2 + 2?", "response": " 4"}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}

A prompt/response record is the tokens of the prompt followed by the tokens of the
response, nothing added (with the byte tokenizer: exactly the bytes of p, then of r). A
conversation is rendered by a chat template (training/chat_template.py). Next to the
tokens goes a mask: 1 for a token the loss is computed on (the response; the assistant
turns), 0 otherwise. A record's first token is never trained: nothing of its own record
comes before it to predict it from, which is also how transformers computes the loss from
``labels`` (shifted by one inside the model).

Records are packed whole, in their order, into sequences of seq_len + 1 tokens (next-fit:
a record that does not fit in what is left of a sequence starts the next one), the rest
padded with EOS and masked. A sequence's inputs are its first seq_len tokens, its labels
the last seq_len with -100 wherever the mask is 0 -- the same (inputs, labels) shape as a
pretraining window. A record longer than seq_len + 1 tokens is cut to its first seq_len + 1
(counted, and said in a warning): the end of its response is not trained on. With
[training] document_masking (the default) each token also gets its position in its own
record, and the model attends inside each record only (models/documents.py), so a
record is trained exactly as if it were alone in its sequence.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

from meshtrain.training import chat_template
from meshtrain.training.config import ConfigError

IGNORE_INDEX = -100  # training/chunked_loss.py's (torch-free here): a label not trained on
SUFFIXES = (".jsonl", ".parquet")
FORMAT_HELP = ('a record is {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]} '
               "with at least one assistant turn")


def record_files(path: str) -> list[Path]:
    """A .jsonl / .parquet file, or every one under a folder, sorted (the same order everywhere)."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ConfigError(f'[training] dataset = "sft": dataset_path "{path}" does not exist')
    files = sorted((p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError(f'[training] dataset = "sft": no .jsonl or .parquet files under "{path}"')
    return files


class Line:
    """Where a jsonl record is, "FILE:LINE", worked out only when a message needs it: a
    chunk of a big file does not know how many lines come before it (``lines_before``)."""

    def __init__(self, path: str, index: int, lines_before=lambda: 0):
        self.path, self.index, self.lines_before = path, index, lines_before

    def __str__(self) -> str:
        return f"{self.path}:{self.lines_before() + self.index + 1}"


def jsonl_records(text: str, path: str, lines_before=lambda: 0) -> Iterator[tuple[Line, dict]]:
    """(where, record) for each non-blank line of jsonl ``text``.
    Lines end at \n only: a JSON string may hold other line separators (U+2028)."""
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        where = Line(path, i, lines_before)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON ({err})") from None
        yield where, record


def parquet_records(path: str, row_group: int | None = None, first_row: int = 0) -> Iterator[tuple[str, dict]]:
    """(where, record) for each row of a .parquet file (or of one of its row groups);
    ``where`` is "FILE: row N" (from 0). Columns: prompt and response, or messages."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading parquet needs pyarrow: pip install pyarrow "
                          f"(or pip install meshtrain[data])") from None
    file = pq.ParquetFile(path)
    table = file.read() if row_group is None else file.read_row_group(row_group)
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {first_row + i}", row


def pieces(record, where, template: str, tokenizer: str) -> list[tuple[str, bool]]:
    """The record as text pieces, each marked trained or not; ConfigError naming ``where``
    when it is not a record with a response."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a {type(record).__name__}, not a record; {FORMAT_HELP}")
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ConfigError(f'{where}: "messages" must be a list of {{"role": str, "content": str}}; {FORMAT_HELP}')
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            raise ConfigError(f"{where}: the conversation has no assistant turn with content: nothing to train "
                              f"on; {FORMAT_HELP}")
        if template == "plain":
            return chat_template.plain_pieces(messages)
        try:
            return chat_template.template_pieces(messages, tokenizer)
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None
    prompt, response = record.get("prompt"), record.get("response")
    if not isinstance(response, str) or not response:
        found = "no" if response is None else ("an empty" if response == "" else f"a {type(response).__name__}")
        raise ConfigError(f'{where}: record has {found} "response": nothing to train on; {FORMAT_HELP}')
    if not isinstance(prompt, str):
        found = "no" if prompt is None else f"a {type(prompt).__name__}"
        raise ConfigError(f'{where}: record has {found} "prompt" (use "" for none); {FORMAT_HELP}')
    return [(prompt, False), (response, True)]


def encode(pieces_: list[tuple[str, bool]], tok) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, loss mask uint8) of a record's pieces, each tokenized on its own
    (so a response never shares a token with its prompt); the first token is never trained."""
    ids = [tok.encode(text).numpy().astype(np.int64) if text else np.empty(0, np.int64) for text, _ in pieces_]
    mask = [np.full(len(i), trained, dtype=np.uint8) for i, (_, trained) in zip(ids, pieces_)]
    ids, mask = np.concatenate(ids), np.concatenate(mask)
    if len(mask):
        mask[0] = 0
    return ids, mask


def encode_records(records, tok, template: str, tokenizer: str, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mask, lengths) of (where, record) pairs: every record's tokens end to end
    in ``dtype``, their loss mask (uint8) beside them, and each record's length."""
    ids, masks = [], []
    for where, record in records:
        i, m = encode(pieces(record, where, template, tokenizer), tok)
        ids.append(i)
        masks.append(m)
    lengths = np.array([len(i) for i in ids], dtype=np.int64)
    tokens = np.concatenate(ids).astype(dtype) if ids else np.empty(0, dtype)
    mask = np.concatenate(masks) if masks else np.empty(0, np.uint8)
    return tokens, mask, lengths


def pack(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """First record of each sequence, plus len(lengths) at the end: records, taken in order,
    fill a sequence of ``capacity`` tokens while they fit (``lengths`` already at most
    ``capacity``). One searchsorted per sequence, over the running total of the lengths."""
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    starts, i, n = [], 0, len(lengths)
    while i < n:
        starts.append(i)
        i = int(np.searchsorted(ends, ends[i] + capacity, side="right")) - 1
    return np.array(starts + [n], dtype=np.int64)


def truncate(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Each record's length cut to ``capacity``, with a warning that counts the cut ones."""
    long = lengths > capacity
    if long.any():
        warnings.warn(f'[training] dataset = "sft": {int(long.sum()):,} of {len(lengths):,} records are longer than '
                      f"seq_len + 1 = {capacity} tokens; each is cut to its first {capacity} tokens, so the rest "
                      f"of its response is not trained on (raise seq_len to keep them whole)", stacklevel=2)
    return np.minimum(lengths, capacity)


def sequence(tokens, mask, starts, lengths, first: int, last: int, capacity: int, pad_id: int):
    """(tokens, mask, positions) of the packed sequence holding records [first, last) of
    those packed: each record's first ``lengths[r]`` tokens from ``starts[r]``, then
    padding (mask 0) up to ``capacity``. A token's position counts from 0 at its record's
    start; the padding is one more document, from 0 too (models/documents.py reads the
    boundaries from the zeros)."""
    buf = np.full(capacity, pad_id, dtype=np.int64)
    keep = np.zeros(capacity, dtype=bool)
    positions = np.empty(capacity, dtype=np.int64)
    at = 0
    for r in range(first, last):
        start, n = int(starts[r]), int(lengths[r])
        buf[at:at + n] = tokens[start:start + n]
        keep[at:at + n] = mask[start:start + n]
        positions[at:at + n] = np.arange(n)
        at += n
    positions[at:] = np.arange(capacity - at)
    return buf, keep, positions


def inputs_and_labels(buf: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A packed sequence of seq_len + 1 tokens as (inputs, labels) of seq_len: each label is
    the next token, or IGNORE_INDEX where that token is not trained."""
    return buf[..., :-1], np.where(keep[..., 1:], buf[..., 1:], IGNORE_INDEX)
