"""meshtrain prepare-data when things go wrong: what --out already holds, a full disk, a
killed worker, text that is not UTF-8; and a prepared folder that does not belong to the
run: another tokenizer, a shard replaced after it was prepared, an old index."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshtrain.training import prepare_data, prepare_units
from meshtrain.training.config import ConfigError
from meshtrain.training.data import build_dataloader, load_tokens
from meshtrain.training.prepare_data import main, prepare
from meshtrain.training.token_files import (INDEX, SAMPLE_BLOCKS, SAMPLE_BYTES, DataDamage, TokenFiles,
                                            index_checksum)
from tests.in_process import refused, tiny_run, train_in_process
from tests.test_prepare_data import bpe_path, corpus, files_of, small_chunks  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parent.parent


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("prepare_data: error: "), err
    return lines[-1]


def run(corpus, out, *more):
    return main([str(corpus), "--out", str(out), "--workers", "1", "--shard-tokens", "3000", *more])


def test_out_that_is_a_file_or_holds_other_files_is_refused_and_left_alone(corpus, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert run(corpus, tmp_path / "notes.txt") == 2
    assert "--out" in (line := error_line(capsys)) and "notes.txt is a file" in line
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert run(corpus, tmp_path / "notes.txt" / "sub") == 2  # a path under a file
    assert "notes.txt" in error_line(capsys)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for flags in ((), ("--overwrite",)):  # never, whatever the flags
        assert run(corpus, mine, *flags) == 2
        assert "thesis.tex" in (line := error_line(capsys)) and "did not write" in line
        assert files_of(mine) == {"thesis.tex": b"years of work"}


def test_another_complete_dataset_is_kept_unless_overwrite_is_given(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(corpus, out) == 0
    before = files_of(out)
    assert run(corpus, out) == 0 and files_of(out) == before  # the same command: done already
    (corpus / "a.txt").write_text("other text " * 100)  # other inputs, same folder
    assert run(corpus, out) == 2
    line = error_line(capsys)
    assert str(out) in line and "complete prepared dataset" in line and "--overwrite" in line
    assert files_of(out) == before
    assert main([str(corpus), "--out", str(out), "--kind", "sft", "--workers", "1"]) == 2  # sft over tokens
    assert files_of(out) == before
    assert run(corpus, out, "--overwrite") == 0
    assert files_of(out) != before
    files = TokenFiles(str(out))
    assert np.array_equal(files.read(0, len(files)), load_tokens("text", str(corpus), "byte").numpy())


def test_an_unfinished_preparation_of_other_inputs_needs_overwrite_too(corpus, tmp_path, capsys, monkeypatch):
    real = prepare_units.tokenize_unit
    calls = []

    def dies_after_five(unit, *args):
        if len(calls) > 5:
            raise KeyboardInterrupt
        calls.append(unit)
        return real(unit, *args)

    monkeypatch.setattr(prepare_data, "tokenize_unit", dies_after_five)
    assert run(corpus, tmp_path / "out") == 130  # Ctrl-C
    monkeypatch.setattr(prepare_data, "tokenize_unit", real)
    shards = files_of(tmp_path / "out")
    assert any(n.startswith("shard_") for n in shards) and INDEX not in shards
    assert run(tmp_path / "corpus" / "a.txt", tmp_path / "out") == 2
    assert "unfinished preparation" in error_line(capsys) and files_of(tmp_path / "out") == shards
    assert run(corpus, tmp_path / "out") == 0  # its own command finishes it


def full_disk_after(monkeypatch, budget: int) -> list[int]:
    """os.write fails with ENOSPC once ``budget`` bytes were written: a small disk."""
    real, written = os.write, [0]

    def write(fd, data):
        if written[0] + len(data) > budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)
    return written


def test_a_full_disk_is_one_line_with_the_folder_and_free_space_and_resumes(corpus, tmp_path, capsys):
    assert run(corpus, tmp_path / "ref") == 0
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as disk:
        full_disk_after(disk, 20_000)  # a few shards of 6,000 bytes, then a full disk
        assert run(corpus, out) == 2
    line = error_line(capsys)
    assert "no space left on device" in line and str(out) in line and "free in" in line
    names = set(files_of(out))
    assert INDEX not in names and not [n for n in names if n.endswith(".tmp")]  # nothing looks complete
    assert {"shard_00000.bin", "shard_00001.bin", "prepare.json"} <= names
    assert run(corpus, out) == 0 and files_of(out) == files_of(tmp_path / "ref")  # space freed: it resumes
    records = tmp_path / "r.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"q {i}", "response": f"a {i} " * 9}) + "\n" for i in range(99)))
    with pytest.MonkeyPatch.context() as disk:  # sft: its arrays are one file each
        full_disk_after(disk, 1000)
        assert main([str(records), "--out", str(tmp_path / "sft"), "--kind", "sft", "--workers", "1"]) == 2
    assert "no space left on device" in error_line(capsys)
    assert not [p for p in (tmp_path / "sft").iterdir() if p.name != "prepare.json"]


KILLER = """
import os, signal, sys
from meshtrain.training import prepare_data, prepare_units
prepare_units.CHUNK_BYTES = 1000
parent, real = os.getpid(), prepare_units.tokenize_unit
def tokenize(unit, *args):
    if os.getpid() != parent and unit.start > 0:  # a worker, on a later chunk: as the OOM killer would
        os.kill(os.getpid(), signal.SIGKILL)
    return real(unit, *args)
prepare_data.tokenize_unit = tokenize
sys.exit(prepare_data.main(sys.argv[1:]))
"""


def test_a_killed_worker_ends_the_preparation_with_a_message_instead_of_a_hang(corpus, tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLER, str(corpus), "--out", str(tmp_path / "out"),
                           "--workers", "2", "--shard-tokens", "3000"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "worker process died" in line and "out-of-memory" in line and "--workers" in line
    assert not (tmp_path / "out" / INDEX).exists()


TERMINATED = r"""
import os, signal, time
from concurrent.futures import ProcessPoolExecutor
from meshtrain.training import prepare_data
def busy(_):
    end = time.time() + 10
    while time.time() < end:
        sum(range(1000))
signal.signal(signal.SIGTERM, signal.default_int_handler)  # as prepare-data's main installs it
pool = ProcessPoolExecutor(1, initializer=prepare_data._quiet_worker)
pool.submit(busy, 0)
time.sleep(1.0)
for pid in list(pool._processes):
    os.kill(pid, signal.SIGTERM)  # what the executor does to the workers left when another dies
time.sleep(1.0)
os._exit(0)
"""


def test_a_worker_terminated_mid_chunk_dies_silently():
    """A worker busy in Python when the broken pool terminates it: with the parent's SIGTERM
    handler inherited it raised KeyboardInterrupt, printing a traceback (seen under load in
    the killed-worker test) or leaving the pool hanging (this test then times out)."""
    proc = subprocess.run([sys.executable, "-c", TERMINATED], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("encoding,bom", [("utf-16", True), ("utf-16-le", False), ("utf-32", True)])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_text_that_is_not_utf8_is_refused_naming_the_file(tmp_path, capsys, encoding, bom, suffix):
    text = "\n".join(json.dumps({"text": f"record {i} with words"}) for i in range(40)) + "\n"
    path = tmp_path / f"wide{suffix}"
    path.write_bytes(text.encode(encoding))
    assert path.read_bytes()[:2] in (b"\xff\xfe", b"\xfe\xff") if bom else path.read_bytes()[1] == 0
    assert main([str(path), "--out", str(tmp_path / "out"), "--workers", "1"]) == 2
    line = error_line(capsys)
    assert str(path) in line and "not UTF-8" in line and "iconv" in line
    assert ("byte-order mark:" in line) == bom and ("characters are NUL bytes" in line) == (not bom)
    assert not (tmp_path / "out" / INDEX).exists()
    with pytest.raises(ConfigError, match=rf"{path.name}.*not UTF-8"):  # dataset = "text" reads it in memory
        load_tokens("text", str(path), "byte")


def tokens_cfg(folder, tokenizer):
    return SimpleNamespace(seq_len=16, global_batch_size=8, local_batch_size=0, seed=0, dataset="tokens",
                           dataset_path=str(folder), tokenizer=tokenizer)


def test_training_under_another_tokenizer_is_refused_naming_both(corpus, tmp_path, bpe_path):
    prepare([str(corpus)], str(tmp_path / "out"), tokenizer=bpe_path, shard_tokens=3000, progress=False)
    with pytest.raises(ConfigError, match=r'tokenizer = "byte" is not the tokenizer .*index\.json.*tokenizer\.json'):
        build_dataloader(tokens_cfg(tmp_path / "out", "byte"), dp_rank=0, dp_size=1)
    copy = tmp_path / "elsewhere" / "tokenizer.json"  # the same file under another path is the same tokenizer
    copy.parent.mkdir()
    shutil.copy(bpe_path, copy)
    build_dataloader(tokens_cfg(tmp_path / "out", str(copy)), dp_rank=0, dp_size=1)
    spec = json.loads(copy.read_text())  # same vocabulary size, other merges: another tokenizer
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    copy.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"is not the tokenizer.*prepared with"):
        build_dataloader(tokens_cfg(tmp_path / "out", str(copy)), dp_rank=0, dp_size=1)


@pytest.fixture
def big(tmp_path):
    """One shard of 200,000 byte tokens: far more than the 64 KiB its sample hash reads."""
    rng = np.random.default_rng(0)
    (tmp_path / "big.txt").write_text(" ".join(rng.choice(["alpha", "beta", "gamma"], 40_000)))
    prepare([str(tmp_path / "big.txt")], str(tmp_path / "big"), shard_tokens=1 << 20, progress=False)
    return tmp_path / "big"


def test_a_shard_replaced_after_preparing_is_named_when_first_read(big):
    shard = big / "shard_00000.bin"
    data = bytearray(shard.read_bytes())
    data[:2] = (65).to_bytes(2, "little")  # in the first sampled block: same size, other content
    shard.write_bytes(bytes(data))
    files = TokenFiles(str(big))  # start-up reads sizes only
    with pytest.raises(DataDamage, match=r"shard_00000\.bin does not match the checksum.*prepare the folder again"):
        files.read(0, 8)


def test_an_id_beyond_the_vocabulary_is_named_with_its_shard_not_an_index_error(big, tmp_path):
    shard = big / "shard_00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    sampled = np.zeros(len(tokens), bool)  # the blocks sample_sha256 reads, in tokens
    n = len(tokens) * 2
    for k in range(SAMPLE_BLOCKS):
        at = (n - SAMPLE_BYTES) * k // (SAMPLE_BLOCKS - 1) // 2
        sampled[at:at + SAMPLE_BYTES // 2 + 1] = True
    tokens[~sampled] = 60_000  # everywhere the sample hash cannot see: only the id check can
    tokens.tofile(shard)
    first = int(np.argmin(sampled))
    dl, _ = build_dataloader(SimpleNamespace(**{**vars(tokens_cfg(big, "byte")), "global_batch_size": 2}),
                             dp_rank=0, dp_size=1)
    with pytest.raises(DataDamage, match=rf"shard_00000\.bin holds token id 60000 at token {first:,}, beyond the "
                                         r"vocabulary of 258"):
        dl._windows(torch.tensor([first // 17]))
    # A whole run: one line naming the shard, exit 2, no traceback from the embedding.
    result = train_in_process(*tiny_run(tmp_path, "run", "--training.dataset=tokens",
                                        f"--training.dataset_path={big}", "--training.steps=2",
                                        "--checkpoint.enable=false"))
    assert "shard_00000.bin holds token id 60000" in refused(result)


def test_an_index_of_an_earlier_version_is_refused_with_prepare_again(big):
    index = json.loads((big / INDEX).read_text())
    old = {**{k: v for k, v in index.items() if k != "tokenizer_id"}, "version": 1,
           "shards": [{k: s[k] for k in ("file", "tokens", "sha256")} for s in index["shards"]]}
    old["checksum"] = index_checksum(old)
    (big / INDEX).write_text(json.dumps(old))
    with pytest.raises(ConfigError, match=r"earlier meshtrain \(index version 1\).*prepare the folder again"):
        TokenFiles(str(big))


def test_sft_folders_check_their_tokenizer_and_files_too(tmp_path, bpe_path):
    from meshtrain.training.sft_files import SFTRecords, build_sft_loader

    with open(tmp_path / "r.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": f"question {i}", "response": f"answer {i} " * 3}) + "\n")
    prepare_data.prepare_sft([str(tmp_path / "r.jsonl")], str(tmp_path / "sft"), workers=1)
    cfg = SimpleNamespace(**{**vars(tokens_cfg(tmp_path / "sft", bpe_path)), "dataset": "sft"})
    with pytest.raises(ConfigError, match=r"is not the tokenizer .*prepared with \(\"byte\""):
        build_sft_loader(cfg, None, local=8, dp_rank=0, dp_size=1)
    tokens = tmp_path / "sft" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    tokens.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"tokens\.bin does not match the checksum"):
        SFTRecords.from_folder(str(tmp_path / "sft"))


def test_a_second_preparer_of_one_folder_is_refused_while_the_first_lives(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (out / "prepare.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid,
                                                      "started": 0}))
        assert run(corpus, out) == 2
        line = error_line(capsys)
        assert f"being prepared by pid {other.pid}" in line and "prepare.lock" in line
        assert files_of(out) == {"prepare.lock": (out / "prepare.lock").read_bytes()}
    finally:
        other.kill()
        other.wait()
    assert run(corpus, out) == 0  # its holder is gone: taken over, and let go at the end
    assert "prepare.lock" not in files_of(out) and (out / INDEX).is_file()


def test_sigterm_while_preparing_is_one_line_and_the_same_command_resumes(corpus, tmp_path, capsys, monkeypatch):
    assert run(corpus, tmp_path / "ref") == 0
    real, calls = prepare_units.tokenize_unit, []

    def terminated_on_the_eighth(unit, *args):
        calls.append(unit)
        if len(calls) == 8:
            os.kill(os.getpid(), signal.SIGTERM)  # a cancelled job
        return real(unit, *args)

    monkeypatch.setattr(prepare_data, "tokenize_unit", terminated_on_the_eighth)
    assert run(corpus, tmp_path / "out") == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("prepare_data: interrupted")
    names = set(files_of(tmp_path / "out"))
    assert INDEX not in names and not [n for n in names if n.endswith((".tmp", ".lock"))]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setattr(prepare_data, "tokenize_unit", real)
    assert run(corpus, tmp_path / "out") == 0 and files_of(tmp_path / "out") == files_of(tmp_path / "ref")


def test_inputs_with_no_text_are_refused_and_leave_no_dataset(tmp_path, capsys):
    """An empty file (or jsonl whose text is all empty): no tokens at all. Refused at once,
    rather than a dataset of nothing that training would refuse later as too small."""
    (tmp_path / "empty.txt").write_text("")
    assert run(tmp_path / "empty.txt", tmp_path / "out") == 2
    line = error_line(capsys)
    assert "empty.txt: no text to tokenize" in line and "--text-key" in line
    assert not (tmp_path / "out").exists()
