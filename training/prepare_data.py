"""Tokenize a corpus once, into the shards that ``[training] dataset = "tokens"`` reads.

    meshtrain prepare-data data/ more.jsonl --tokenizer tokenizer.json --out tokens/
    meshtrain prepare-data --verify tokens/     # every shard's sha256 against the index

Inputs are text files (one document each), .jsonl (one per line, its --text-key field)
and .parquet (one per row, its --text-key column; needs pyarrow); folders are walked.
`--kind sft` prepares instruction records for ``dataset = "sft"`` instead
(training/sft_files.py, docs/finetuning.md).
Workers tokenize units (training/prepare_units.py) in parallel; this process takes their
results in input order and cuts the stream into shards of --shard-tokens, so the files
are the same whatever --workers is. Each shard is written to a .tmp and renamed, then
recorded in prepare.json with where the stream goes on after it; a rerun of the same
command keeps the shards that are there intact and starts tokenizing where the last one
ended. index.json is written last: a folder without it is not a dataset yet. What --out
may already hold, and how a full disk is reported: training/prepare_out.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from meshtrain.training import chat_template, sft, sft_files
from meshtrain.training.config import ConfigError
from meshtrain.training.data import HFTokenizer, build_tokenizer
from meshtrain.training.prepare_units import (check_decodable, input_files, plan_units, tokenize_sft_unit,
                                              tokenize_unit)
from meshtrain.training.prepare_out import PrepareFailure, check_out, claimed, describe_os_error, write_all
from meshtrain.training.token_files import (FORMAT, INDEX, VERSION, TokenFiles, index_checksum, sample_sha256,
                                            token_dtype, tokenizer_id)

PROGRESS = "prepare.json"  # the index in progress: the plan, and the shards done so far
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16: few files, yet a lost shard is quick to redo


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    write_all(tmp, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())
    os.replace(tmp, path)


_line_open = False  # the progress line is waiting for its end: a message starts a new line


def _say(message: str) -> None:
    global _line_open
    print(("\n" if _line_open else "") + message, file=sys.stderr, flush=True)
    _line_open = False


class Progress:
    """One line on stderr, rewritten about once a second."""

    def __init__(self, total_bytes: int, enabled: bool = True):
        self.total, self.enabled, self.t0, self.last = total_bytes, enabled, time.time(), 0.0

    def update(self, done: int, tokens: int, final: bool = False) -> None:
        now = time.time()
        if not self.enabled or (now - self.last < 1 and not final):
            return
        global _line_open
        self.last, rate, _line_open = now, tokens / max(now - self.t0, 1e-9), not final
        eta = (self.total - done) * (now - self.t0) / done if done else 0
        print(f"\rprepare_data: {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, {tokens:,} tokens, "
              f"{rate / 1e6:.2f}M tokens/s, ETA {eta:,.0f}s ", end="\n" if final else "",
              file=sys.stderr, flush=True)


def _quiet_worker() -> None:
    """A worker leaves Ctrl-C to the parent, and dies silently when the pool ends it: it
    inherits (fork) the parent's SIGTERM handler, which raises KeyboardInterrupt, so a
    worker terminated mid-chunk after another was killed printed a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _results(units, spec, text_key, dtype, workers, tokenize=None):
    """Each unit's ``tokenize`` (default tokenize_unit) result, in order, from at most
    2 x workers units in flight."""
    tokenize = tokenize or tokenize_unit
    if workers <= 1:
        yield from (tokenize(u, spec, text_key, dtype) for u in units)
        return
    # concurrent.futures, not multiprocessing.Pool: a worker killed by the system (the OOM
    # killer) breaks the pool and every pending result raises, where Pool waits forever.
    pool = ProcessPoolExecutor(workers, initializer=_quiet_worker)
    try:
        todo, pending = iter(units), deque()
        for unit in todo:
            pending.append(pool.submit(tokenize, unit, spec, text_key, dtype, False))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise PrepareFailure(f"a worker process died while tokenizing (killed by the system: most often the "
                             f"out-of-memory killer, which the kernel log names); run the same command again "
                             f"with fewer --workers (now {workers})") from None
    finally:  # an error or Ctrl-C: drop the units not started rather than tokenize them for nothing
        pool.shutdown(wait=True, cancel_futures=True)


def prepare(inputs: list[str], out: str, tokenizer: str = "byte", workers: int = 1,
            text_key: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS,
            progress: bool = True, overwrite: bool = False) -> dict:
    """Write the shards and index.json of ``inputs`` into ``out``; returns the index."""
    with claimed(Path(out)):
        return _prepare(inputs, out, tokenizer, workers, text_key, shard_tokens, progress, overwrite)


def _prepare(inputs, out, tokenizer, workers, text_key, shard_tokens, progress, overwrite) -> dict:
    tok = build_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    units = plan_units(input_files(inputs), text_key)
    out_dir = Path(out)
    # Everything the output depends on; a rerun with the same plan may keep what is there.
    plan = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "text_key": text_key,
            "tokenizer_sha256": _sha256(Path(tokenizer)) if isinstance(tok, HFTokenizer) else None,
            "shard_tokens": shard_tokens, "dtype": dtype,
            "inputs": [[u.kind, u.path, u.start, u.end, os.stat(u.path).st_mtime_ns] for u in units]}
    plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    check_out(out_dir, overwrite=overwrite, same_plan=lambda: _progress(out_dir).get("plan") == plan_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = _kept_shards(out_dir, plan_id)
    index_path = out_dir / INDEX
    if shards and shards[-1]["next"]["unit"] == len(units) and index_path.is_file():
        return json.loads(index_path.read_text())  # done before, nothing changed
    index_path.unlink(missing_ok=True)  # the shards are about to change
    where = shards[-1]["next"] if shards else {"unit": 0, "offset": 0, "documents": 0}
    documents, skip = where["documents"], 0 if shards else 1  # 1: the stream starts without EOS
    buf, fill = np.empty(shard_tokens, dtype=dtype), 0
    bytes_total = sum(u.nbytes for u in units)
    done_bytes = sum(u.nbytes for u in units[:where["unit"]])
    bar, tokens_made = Progress(bytes_total, progress), 0
    file_counts: dict[str, list[int]] = {}

    def finish_shard(next_unit: int, offset: int, docs_before: int) -> None:
        nonlocal fill
        name = f"shard_{len(shards):05d}.bin"
        tmp = out_dir / (name + ".tmp")
        write_all(tmp, buf[:fill])
        os.replace(tmp, out_dir / name)
        shards.append({"file": name, "tokens": fill, "sha256": _sha256(out_dir / name),
                       "sample_sha256": sample_sha256(buf[:fill]), "max_id": int(buf[:fill].max()),
                       "next": {"unit": next_unit, "offset": offset, "documents": docs_before}})
        _write_json(out_dir / PROGRESS, {"plan": plan_id, "shards": shards})
        fill = 0

    first = where["unit"]
    for u, (tokens, ndocs, bad, chars, nuls) in enumerate(
            _results(units[first:], tokenizer, text_key, dtype, workers), first):
        unit, pos = units[u], where["offset"] if u == first else 0
        # Undecodable bytes are judged per file, over all its units (after a resume, over
        # the units read in this run).
        counts = file_counts.setdefault(unit.path, [0, 0, 0])
        counts[0] += bad
        counts[1] += chars
        counts[2] += nuls
        if u + 1 == len(units) or units[u + 1].path != unit.path:  # the file's last unit
            note = check_decodable(unit.path, *counts)
            if note:
                _say(f"prepare_data: {note}")
        documents += ndocs
        drop = min(skip, len(tokens) - pos)
        pos, skip = pos + drop, skip - drop
        while pos < len(tokens):
            n = min(shard_tokens - fill, len(tokens) - pos)
            buf[fill:fill + n] = tokens[pos:pos + n]
            fill, pos, tokens_made = fill + n, pos + n, tokens_made + n
            if fill == shard_tokens:
                finish_shard(u, pos, documents - ndocs)
        done_bytes += unit.nbytes
        bar.update(done_bytes, tokens_made)
    if fill:
        finish_shard(len(units), 0, documents)
    bar.update(done_bytes, tokens_made, final=True)
    if not shards:  # a dataset of nothing would only fail later, at training's "corpus too small"
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise ConfigError(f"{', '.join(inputs)}: no text to tokenize (0 tokens; for .jsonl/.parquet, is "
                          f'"{text_key}" the field that holds it? see --text-key); nothing was written to {out}')
    index = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "tokenizer_id": tokenizer_id(tokenizer),
             "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": dtype, "num_documents": documents,
             "num_tokens": sum(s["tokens"] for s in shards), "shard_tokens": shard_tokens,
             "shards": [{k: s[k] for k in ("file", "tokens", "sha256", "sample_sha256", "max_id")}
                        for s in shards]}
    index["checksum"] = index_checksum(index)
    _write_json(index_path, index)
    return index


def prepare_sft(inputs: list[str], out: str, tokenizer: str = "byte", workers: int = 1,
                template_choice: str = "auto", overwrite: bool = False) -> dict:
    with claimed(Path(out)):
        return _prepare_sft(inputs, out, tokenizer, workers, template_choice, overwrite)


def _prepare_sft(inputs, out, tokenizer, workers, template_choice, overwrite) -> dict:
    """`--kind sft`: tokenize the instruction records of ``inputs`` into ``out`` (the files
    training/sft_files.py maps: tokens.bin, mask.bin, offsets.bin, then index.json); returns
    the index. Each unit's arrays are appended as they come, in input order; no resume."""
    tok = build_tokenizer(tokenizer)
    template = chat_template.resolve(template_choice, tokenizer)
    dtype = token_dtype(tok.vocab_size)
    units = plan_units([f for path in inputs for f in sft.record_files(path)], None)
    out_dir = Path(out)
    # The same command again rewrites its own folder; anything else needs --overwrite.
    plan = {"format": sft_files.FORMAT, "version": sft_files.VERSION, "tokenizer": tokenizer_id(tokenizer),
            "template": template, "inputs": [[u.path, u.start, os.stat(u.path).st_mtime_ns] for u in units]}
    plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    check_out(out_dir, overwrite=overwrite, same_plan=lambda: _progress(out_dir).get("plan") == plan_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / sft_files.INDEX).unlink(missing_ok=True)  # a folder without its index is not a dataset
    _write_json(out_dir / PROGRESS, {"plan": plan_id})
    tmp = {key: out_dir / (name + ".tmp") for key, name in sft_files.FILES.items()}
    handles = {key: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for key, path in tmp.items()}
    records = trained = total = max_id = 0
    try:
        write_all(tmp["offsets"], np.zeros(1, np.int64), handles["offsets"])
        for tokens, mask, lengths in _results(units, tokenizer, template, dtype, workers, tokenize_sft_unit):
            write_all(tmp["tokens"], tokens, handles["tokens"])
            write_all(tmp["mask"], mask, handles["mask"])
            write_all(tmp["offsets"], (total + np.cumsum(lengths)).astype(np.int64), handles["offsets"])
            records, trained, total = records + len(lengths), trained + int(mask.sum()), total + len(tokens)
            max_id = max(max_id, int(tokens.max()) if len(tokens) else 0)
    except BaseException:
        for path in tmp.values():  # a half-written array is of no use, and takes the space
            path.unlink(missing_ok=True)
        raise
    finally:
        for fd in handles.values():
            os.close(fd)
    for key, path in tmp.items():
        os.replace(path, out_dir / sft_files.FILES[key])
    index = {"format": sft_files.FORMAT, "version": sft_files.VERSION, "tokenizer": tokenizer,
             "tokenizer_id": tokenizer_id(tokenizer), "max_id": max_id,
             "vocab_size": tok.vocab_size, "pad_id": tok.eos_id, "dtype": dtype, "chat_template": template,
             "num_records": records, "num_tokens": total, "num_trained_tokens": trained,
             "files": {name: _sha256(out_dir / name) for name in sft_files.FILES.values()},
             "samples": {name: _sample_of(out_dir / name) for name in sft_files.FILES.values()}}
    index["checksum"] = sft_files.index_checksum(index)
    _write_json(out_dir / sft_files.INDEX, index)
    return index


def _progress(out_dir: Path) -> dict:
    try:
        progress = json.loads((out_dir / PROGRESS).read_text())
    except (OSError, ValueError):
        return {}
    return progress if isinstance(progress, dict) else {}


def _sample_of(path: Path) -> str:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return sample_sha256(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return sample_sha256(mm)


def _kept_shards(out_dir: Path, plan_id: str) -> list[dict]:
    """The shards of an earlier run of the same plan that are still intact, in order up to
    the first one that is not (check_out has refused or removed any other plan's)."""
    progress = _progress(out_dir)
    if progress.get("plan") != plan_id or "shards" not in progress:
        return []
    kept = []
    for shard in progress["shards"]:
        path = out_dir / shard["file"]
        if not path.is_file() or _sha256(path) != shard["sha256"]:
            break
        kept.append(shard)
    return kept


def verify(folder: str) -> str:
    """Every byte of every shard against index.json; ConfigError naming the first bad one."""
    files = TokenFiles(folder, key="--verify")  # the index and the shard sizes
    shards = json.loads((Path(folder) / INDEX).read_text())["shards"]
    for shard, path in zip(shards, files.paths):
        if _sha256(path) != shard["sha256"]:
            raise ConfigError(f"--verify {folder}: {path} does not match its sha256 in the index")
    return f"{folder}: {len(shards)} shards, {files.num_tokens:,} tokens, every sha256 matches"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshtrain prepare-data", description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="*", help="text/.jsonl/.parquet files, or folders of them")
    p.add_argument("--tokenizer", default="byte", help="byte, or the path of a tokenizer.json")
    p.add_argument("--out", help="output folder")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--text-key", default="text", help="the text field of jsonl / column of parquet")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--verify", metavar="DIR", help="check a prepared folder's shards byte for byte")
    p.add_argument("--kind", choices=("text", "sft"), default="text",
                   help="text: documents for dataset = \"tokens\"; sft: prompt/response or chat records for "
                        "dataset = \"sft\" (docs/finetuning.md)")
    p.add_argument("--chat-template", choices=("auto", "tokenizer", "plain"), default="auto",
                   help="--kind sft: the template of \"messages\" records (as [training] chat_template)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset prepared in --out from other inputs or settings (only the files "
                        "prepare-data writes are removed; a folder holding other files is always refused)")
    args = p.parse_args(argv)
    try:  # SIGTERM (a cancelled job) ends like Ctrl-C: the .tmp being written is removed on the way out
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    except ValueError:  # not the main thread
        previous = None
    try:
        if args.verify:
            print(verify(args.verify))
            return 0
        if not args.inputs or not args.out:
            p.error("give INPUT... and --out (or --verify DIR)")
        if args.shard_tokens < 1 or args.workers < 1:
            p.error("--shard-tokens and --workers must be at least 1")
        if args.kind == "sft":
            index = prepare_sft(args.inputs, args.out, args.tokenizer, args.workers, args.chat_template,
                                overwrite=args.overwrite)
            print(f"{args.out}: {index['num_records']:,} records, {index['num_tokens']:,} tokens, "
                  f"{index['num_trained_tokens']:,} of them trained on")
            return 0
        index = prepare(args.inputs, args.out, args.tokenizer, args.workers, args.text_key, args.shard_tokens,
                        overwrite=args.overwrite)
    except (ConfigError, PrepareFailure) as err:
        _say(f"prepare_data: error: {err}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C (SIGTERM too, below): what is finished stays
        _say("prepare_data: interrupted; finished shards are kept, and the same command resumes after them"
             if args.kind == "text" else "prepare_data: interrupted; run the same command again")
        return 130
    except OSError as err:  # the file system's refusal (a full disk, a read-only folder): no traceback
        if err.errno is None:
            raise
        kept = ("Complete datasets and finished shards are as they were; once fixed, the same command "
                "resumes after the last finished shard" if args.kind == "text" else
                "Complete datasets are as they were; once fixed, run the same command again")
        _say(f"prepare_data: error: {describe_os_error(err, Path(args.out or args.verify), kept)}")
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"{args.out}: {index['num_documents']:,} documents, {index['num_tokens']:,} tokens "
          f"in {len(index['shards'])} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
