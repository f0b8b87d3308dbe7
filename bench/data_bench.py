"""Data at scale: preparing a corpus, and training from it, measured on generated text.

    python bench/data_bench.py --sizes 50M,200M          # small: minutes on 2 cores
    python bench/data_bench.py --sizes 1G,4G --workers 16 --tokenizer tokenizer.json

For each size a corpus of that many bytes (jsonl, generated from a fixed seed, so every
run reads the same text) is written to a temporary folder. Printed side by side:

1. prepare: tokens/s of ``meshtrain prepare-data`` with the byte tokenizer and
   with a tokenizer.json (--tokenizer, or a BPE of --bpe-vocab tokens trained here on the
   first 10 MB), next to the tokenizers library's own ``encode_batch`` on the same
   documents, already in memory -- the ceiling for that tokenizer on this machine.
2. train from the prepared files: in a fresh process, the seconds from nothing to the
   first batch, the data's memory (peak RSS over the process's RSS after its imports)
   once 20 steps of batches are read, and the loader's tokens/s over those 20 steps;
   for the sizes up to --text-max also the same for ``dataset = "text"``, which
   tokenizes the whole corpus in every rank at start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


FILE_BYTES = 32 << 20  # corpus files of this size: several per size, like a real dump
STEPS, SEQ_LEN, BATCH = 20, 2048, 64


def parse_size(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def make_corpus(folder: Path, nbytes: int, seed: int = 0) -> None:
    """jsonl documents of words from a Zipf-like made-up vocabulary (so BPE has merges to
    learn). Words are drawn with numpy: 4 GB of text in minutes, not most of an hour."""
    import numpy as np

    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = np.array(["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(20000)], dtype=object)
    weights = 1 / np.arange(1, len(words) + 1)
    cumulative = np.cumsum(weights / weights.sum())
    written, n = 0, 0
    while written < nbytes:
        with open(folder / f"part_{n:04d}.jsonl", "w") as f:
            size = 0
            while size < FILE_BYTES and written + size < nbytes:
                drawn = np.searchsorted(cumulative, np_rng.random(int(np_rng.integers(50, 1501))))
                text = " ".join(words[np.minimum(drawn, len(words) - 1)]) + "."
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size += len(line)
        written, n = written + size, n + 1


def documents(folder: Path, limit: int | None = None) -> list[str]:
    docs, size = [], 0
    for path in sorted(folder.glob("*.jsonl")):
        for line in open(path):
            docs.append(json.loads(line)["text"])
            size += len(line)
            if limit and size >= limit:
                return docs
    return docs


def train_bpe(docs: list[str], vocab: int, path: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(path))
    return str(path)


def time_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> float:
    from meshtrain.training.prepare_data import prepare

    t0 = time.perf_counter()
    index = prepare([str(corpus)], str(out), tokenizer, workers=workers, progress=False)
    return index["num_tokens"] / (time.perf_counter() - t0)


def time_encode_batch(corpus: Path, tokenizer: str) -> float:
    from tokenizers import Tokenizer

    tok, docs = Tokenizer.from_file(tokenizer), documents(corpus)
    t0, n = time.perf_counter(), 0
    for i in range(0, len(docs), 1000):
        n += sum(len(e.ids) for e in tok.encode_batch(docs[i:i + 1000], add_special_tokens=False))
    return n / (time.perf_counter() - t0)


def child(dataset: str, path: str) -> None:
    """Runs in a fresh process: start-up to first batch, data memory, loader tokens/s."""
    from types import SimpleNamespace

    import meshtrain.training.data  # noqa: F401  (imports are not data: counted in the baseline)
    import meshtrain.training.token_files  # noqa: F401
    from meshtrain.training.data import build_dataloader

    def rss(field):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

    base, anon = rss("VmRSS:"), rss("RssAnon:")
    cfg = SimpleNamespace(seq_len=SEQ_LEN, global_batch_size=BATCH, local_batch_size=0, seed=0,
                          dataset=dataset, dataset_path=path, tokenizer="byte")
    t0 = time.perf_counter()
    loader, _ = build_dataloader(cfg, dp_rank=0, dp_size=1)
    loader.batch(0)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for step in range(1, STEPS + 1):
        loader.batch(step)
    rate = STEPS * BATCH * SEQ_LEN / (time.perf_counter() - t1)
    print(json.dumps({"first_batch_s": first, "data_rss": rss("VmHWM:") - base,
                      "data_anon": rss("RssAnon:") - anon, "tokens_per_s": rate}))


def measure(dataset: str, path: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", dataset, str(path)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="50M,200M", help="corpus sizes in bytes, e.g. 1G,4G")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--tokenizer", help="a tokenizer.json; default: train a BPE here")
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--text-max", default="1G", help="measure dataset = text only up to this size")
    p.add_argument("--bpe-max", default="1G", help="measure the tokenizer.json prepare and encode_batch "
                   "only up to this size (about 1M tokens/s on 2 cores: 4 GB would take an hour)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    sizes = [s.strip() for s in args.sizes.split(",")]
    print(f"data_bench: {os.cpu_count()} CPU cores, --workers {args.workers}, "
          f"batches of {BATCH} x {SEQ_LEN} tokens, {STEPS} steps", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = args.tokenizer
        for size in sizes:
            corpus = tmp / f"corpus_{size}"
            corpus.mkdir()
            make_corpus(corpus, parse_size(size))
            if tokenizer is None:
                tokenizer = train_bpe(documents(corpus, 10 << 20), args.bpe_vocab, tmp / "tokenizer.json")
            (tmp / f"bpe_{size}").mkdir()
            row = {"size": size, "byte": time_prepare(corpus, tmp / f"byte_{size}", "byte", args.workers)}
            if parse_size(size) <= parse_size(args.bpe_max):
                row["bpe"] = time_prepare(corpus, tmp / f"bpe_{size}", tokenizer, args.workers)
                row["encode_batch"] = time_encode_batch(corpus, tokenizer)
            row["tokens"] = measure("tokens", tmp / f"byte_{size}")
            if parse_size(size) <= parse_size(args.text_max):
                row["text"] = measure("text", corpus)
            rows.append(row)
            print(f"  {size}: done", flush=True)
            for name in ("byte", "bpe"):
                for f in (tmp / f"{name}_{size}").iterdir():
                    f.unlink()  # keep the temp folder to one corpus's shards at a time
            for f in corpus.iterdir():
                f.unlink()
    print("\nprepare (tokens/s, all workers)      byte        tokenizer.json   encode_batch (1 process)")
    for r in rows:
        bpe = (f"{r['bpe'] / 1e6:8.2f}M         {r['encode_batch'] / 1e6:8.2f}M" if "bpe" in r
               else "       -                 -  (above --bpe-max)")
        print(f"  {r['size']:>6}                      {r['byte'] / 1e6:8.1f}M    {bpe}")
    print("\ntrain from it (byte tokens, 1 rank)  first batch   data RSS (peak)  of it private  loader tokens/s")
    for r in rows:
        for name in ("tokens", "text"):
            if name in r:
                m = r[name]
                print(f"  {r['size']:>6} dataset = {name:<6}      {m['first_batch_s']:7.2f} s  "
                      f"{m['data_rss'] / 2**20:7.0f} MiB      {m['data_anon'] / 2**20:7.0f} MiB   "
                      f"{m['tokens_per_s'] / 1e6:8.1f}M")


if __name__ == "__main__":
    main()
