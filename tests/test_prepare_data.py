"""meshtrain prepare-data and the "tokens" dataset (single process, small corpora)."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshtrain.training import prepare_data, prepare_units
from meshtrain.training.config import ConfigError
from meshtrain.training.data import DataLoader, build_dataloader, load_tokens
from meshtrain.training.prepare_data import main, prepare, verify
from meshtrain.training.shuffle import permute, round_keys
from meshtrain.training.token_files import TokenFileLoader, TokenFiles

SEQ = 16


@pytest.fixture
def corpus(tmp_path):
    """Text files and two jsonl files, ~25K bytes; small chunks so the jsonl files are
    several units each (what parallelism and resuming act on)."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha " * 300)
    (root / "b.md").write_text("# beta\n" + "béta ünïcode " * 200)
    (root / "sub" / "c.py").write_text("print('gamma')\n" * 150)
    for name, n in (("d.jsonl", 60), ("sub/e.jsonl", 40)):
        with open(root / name, "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"{name} record {i} " * (5 + i % 7), "id": i}) + "\n")
    return root


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(prepare_units, "CHUNK_BYTES", 1000)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A small byte-level BPE tokenizer.json with an <|endoftext|> token (~300 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["alpha beta gamma record béta ünïcode print"] * 50, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def make(corpus, out, **kw):
    kw = {"shard_tokens": 3000, "progress": False, **kw}
    return prepare([str(corpus)], str(out), **kw)


def token_loader(folder, *, dp_rank=0, dp_size=1, local=8, global_bs=8, seed=0):
    return TokenFileLoader(TokenFiles(str(folder)), seq_len=SEQ, global_batch_size=global_bs,
                           local_batch_size=local, dp_rank=dp_rank, dp_size=dp_size, seed=seed)


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def test_one_and_two_workers_write_byte_identical_files(corpus, tmp_path):
    one = make(corpus, tmp_path / "w1", workers=1)
    two = make(corpus, tmp_path / "w2", workers=2)
    assert len(one["shards"]) > 3 and one == two
    assert files_of(tmp_path / "w1") == files_of(tmp_path / "w2")


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prepared_stream_is_load_tokens_stream_so_batches_hold_the_same_windows(corpus, tmp_path,
                                                                                  tokenizer, bpe_path):
    spec = bpe_path if tokenizer == "bpe" else "byte"
    index = make(corpus, tmp_path / "out", tokenizer=spec, workers=2)
    files = TokenFiles(str(tmp_path / "out"))
    expected = load_tokens("text", str(corpus), spec).numpy()
    assert np.array_equal(files.read(0, len(files)), expected)
    assert index["num_documents"] == 3 + 60 + 40
    assert files.dtype == np.uint16
    # An epoch of batches from the files is the in-memory loader's windows, reordered.
    mem = DataLoader(torch.from_numpy(expected.astype(np.int32)), seq_len=SEQ, global_batch_size=8,
                     local_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    disk = token_loader(tmp_path / "out")
    rows = lambda dl: sorted(map(tuple, dl._windows(dl._window_ids(0, dl.num_windows))[0].tolist()))
    assert disk.num_windows == mem.num_windows and rows(disk) == rows(mem)
    assert not torch.equal(disk.global_batch(0)[0], mem.global_batch(0)[0])  # another order


def test_an_epoch_reads_every_window_once_in_a_seeded_order(corpus, tmp_path):
    make(corpus, tmp_path / "out")
    dl = token_loader(tmp_path / "out", global_bs=8)
    n = dl.num_windows
    epoch0 = dl._window_ids(0, n).tolist()
    assert sorted(epoch0) == list(range(n)) and epoch0 != list(range(n))
    assert dl._window_ids(n, n).tolist() != epoch0  # a fresh order each epoch
    assert token_loader(tmp_path / "out", seed=1)._window_ids(0, n).tolist() != epoch0
    for size in (1, 2, 3, 7, 64, 1000, 4097):  # a bijection for any size, not just powers of 4
        assert sorted(permute(np.arange(size), size, round_keys(3, 5)).tolist()) == list(range(size))


@pytest.mark.parametrize("dp_size,local", [(2, 4), (4, 2), (2, 1), (4, 1)])
def test_batches_of_a_step_are_the_same_for_every_dp_layout(corpus, tmp_path, dp_size, local):
    make(corpus, tmp_path / "out")
    ref = token_loader(tmp_path / "out")
    for step in (0, 1, ref.num_windows // 8 + 1):  # the last crosses into the second epoch
        mbs = [mb for r in range(dp_size)
               for mb in token_loader(tmp_path / "out", dp_rank=r, dp_size=dp_size, local=local).batch(step)]
        assert torch.equal(torch.cat([i for i, _ in mbs]), ref.global_batch(step)[0])
        assert torch.equal(torch.cat([l for _, l in mbs]), ref.global_batch(step)[1])


def test_resume_from_state_dict_reads_the_next_step(corpus, tmp_path):
    make(corpus, tmp_path / "out")
    dl = token_loader(tmp_path / "out", dp_size=2, local=2)
    dl.batch(0), dl.batch(1)
    state, expected = dl.state_dict(), dl.batch(2)
    resumed = token_loader(tmp_path / "out", dp_size=2, local=4)  # a resume may change the layout
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([i for i, _ in resumed.next_batch()]), torch.cat([i for i, _ in expected]))


def test_a_changed_dataset_is_refused_on_resume(corpus, tmp_path):
    make(corpus, tmp_path / "old")
    state = token_loader(tmp_path / "old").state_dict()
    text = (corpus / "a.txt").read_text()
    (corpus / "a.txt").write_text("A" + text[1:])  # same length, so the same number of windows
    make(corpus, tmp_path / "new")
    new = token_loader(tmp_path / "new")
    assert new.num_windows == state["num_windows"]
    with pytest.raises(ConfigError, match="another dataset"):
        new.load_state_dict(state)


def test_a_truncated_shard_is_refused_at_start_naming_it(corpus, tmp_path):
    make(corpus, tmp_path / "out")
    shard = tmp_path / "out" / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"\[training\] dataset_path.*shard_00001\.bin.*truncated"):
        TokenFiles(str(tmp_path / "out"))


def test_a_folder_of_another_tokenizer_is_refused(corpus, tmp_path, bpe_path):
    make(corpus, tmp_path / "out", tokenizer=bpe_path)
    cfg = SimpleNamespace(seq_len=SEQ, global_batch_size=8, local_batch_size=0, seed=0,
                          dataset="tokens", dataset_path=str(tmp_path / "out"), tokenizer="byte")
    with pytest.raises(ConfigError, match=r'tokenizer = "byte" is not the tokenizer .*index\.json was prepared with'):
        build_dataloader(cfg, dp_rank=0, dp_size=1)
    cfg.tokenizer = bpe_path
    dl, tok = build_dataloader(cfg, dp_rank=0, dp_size=1)
    assert isinstance(dl, TokenFileLoader) and int(dl.batch(0)[0][0].max()) < tok.vocab_size


def test_a_missing_or_inconsistent_index_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"dataset_path.*no .*index\.json.*prepare-data"):
        TokenFiles(str(tmp_path))
    make(corpus, tmp_path / "out")
    path = tmp_path / "out" / "index.json"
    index = json.loads(path.read_text())
    path.write_text(json.dumps({**index, "num_tokens": index["num_tokens"] + 1}))
    with pytest.raises(ConfigError, match="inconsistent"):
        TokenFiles(str(tmp_path / "out"))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a meshtrain token index"):
        TokenFiles(str(tmp_path / "out"))


def test_opening_a_folder_reads_no_tokens_until_a_batch_needs_them(corpus, tmp_path):
    make(corpus, tmp_path / "out")
    dl = token_loader(tmp_path / "out")
    assert dl.tokens._maps == {}  # start-up statted the shards, mapped none
    dl.batch(0)
    assert 0 < len(dl.tokens._maps) <= len(dl.tokens.paths)


def test_verify_finds_a_changed_byte_that_the_size_check_cannot(corpus, tmp_path):
    make(corpus, tmp_path / "out")
    assert "every sha256 matches" in verify(str(tmp_path / "out"))
    shard = tmp_path / "out" / "shard_00002.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    TokenFiles(str(tmp_path / "out"))  # same size: start-up cannot tell
    assert main(["--verify", str(tmp_path / "out")]) == 2


@pytest.mark.parametrize("line,content,message", [
    (5, "{not json", "not valid JSON"),
    (37, '{"body": "no text"}', "has no 'text' field"),
    (37, '{"text": 7}', "is a int, not a string"),
])
def test_bad_jsonl_line_is_one_line_error_naming_file_and_line(tmp_path, capsys, line, content, message):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"line {i} " * 10}) for i in range(1, 51)]
    lines[line - 1] = content  # line 37 is in a later chunk than the first: numbered from the file's start
    path.write_text("\n".join(lines) + "\n")
    assert main([str(path), "--out", str(tmp_path / "out"), "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = err.strip().splitlines()[-1]  # the line after the progress line
    assert err.startswith("prepare_data: error:")
    assert f"bad.jsonl:{line}: " in err and message in err
    assert not (tmp_path / "out" / "index.json").exists()


def test_binary_file_and_missing_pyarrow_are_errors_naming_the_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "blob.txt").write_bytes(bytes(range(128, 256)) * 40)
    assert main([str(tmp_path / "blob.txt"), "--out", str(tmp_path / "out")]) == 2
    assert "blob.txt" in capsys.readouterr().err
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # as if not installed
    assert main([str(tmp_path / "t.parquet"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "t.parquet" in err and "pip install pyarrow" in err


def test_rerun_after_an_interruption_keeps_finished_shards_and_resumes(corpus, tmp_path, monkeypatch):
    reference = make(corpus, tmp_path / "ref")
    real, calls = prepare_units.tokenize_unit, []

    def dies_after_ten(unit, *args):
        calls.append(unit)
        if len(calls) > 10:
            raise KeyboardInterrupt  # the job is killed part way
        return real(unit, *args)

    monkeypatch.setattr(prepare_data, "tokenize_unit", dies_after_ten)
    with pytest.raises(KeyboardInterrupt):
        make(corpus, tmp_path / "out")
    out = tmp_path / "out"
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.bin")}
    assert done and not (out / "index.json").exists()
    calls.clear()
    monkeypatch.setattr(prepare_data, "tokenize_unit", lambda u, *a: calls.append(u) or real(u, *a))
    assert make(corpus, out) == reference
    assert files_of(out) == files_of(tmp_path / "ref")
    assert all((out / name).stat().st_mtime_ns == t for name, t in done.items())  # kept, not rewritten
    assert len(calls) < len(prepare_units.plan_units(prepare_units.input_files([str(corpus)]), "text")) - 5
    calls.clear()
    assert make(corpus, out) == reference and calls == []  # finished: a rerun tokenizes nothing


def test_text_key_names_the_jsonl_field_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text('{"body": "one", "text": "not this"}\n\n{"body": "two"}\n')
    assert main([str(path), "--out", str(tmp_path / "out"), "--text-key", "body", "--workers", "1"]) == 0
    assert "2 documents, 7 tokens in 1 shards" in capsys.readouterr().out
    files = TokenFiles(str(tmp_path / "out"))
    assert files.read(0, len(files)).tolist() == [*b"one", 257, *b"two"]


def test_a_tokens_dataset_without_an_index_is_refused_before_start_up(tmp_path):
    from meshtrain.training import recipe
    from meshtrain.training.config import JobConfig

    cfg = JobConfig()
    cfg.job.output_dir = str(tmp_path / "runs")
    cfg.training.dataset, cfg.training.dataset_path = "tokens", str(tmp_path)
    with pytest.raises(ConfigError, match=r'dataset = "tokens" needs dataset_path.*no index\.json'):
        recipe._check_inputs(cfg)


def test_parquet_rows_give_the_same_tokens_as_jsonl_lines(tmp_path, capsys):
    # One document per row of the --text-key column, read row group by row group; the
    # stream equals the same documents as jsonl. A null row is an error naming its index.
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"parquet document {i} " * (3 + i % 5) for i in range(50)]
    pq.write_table(pa.table({"text": docs, "id": list(range(50))}), tmp_path / "d.parquet", row_group_size=7)
    (tmp_path / "j").mkdir()
    with open(tmp_path / "j" / "d.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    from_parquet = prepare([str(tmp_path / "d.parquet")], str(tmp_path / "p_out"), "byte", workers=2,
                           shard_tokens=500, progress=False)
    from_jsonl = prepare([str(tmp_path / "j" / "d.jsonl")], str(tmp_path / "j_out"), "byte", workers=1,
                         shard_tokens=500, progress=False)
    assert from_parquet["num_documents"] == 50 and from_parquet["num_tokens"] == from_jsonl["num_tokens"]
    assert [s["sha256"] for s in from_parquet["shards"]] == [s["sha256"] for s in from_jsonl["shards"]]

    pq.write_table(pa.table({"text": ["fine", None, "fine"]}), tmp_path / "bad.parquet")
    assert main([str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "bad_out")]) == 2
    assert "bad.parquet: row 1 (from 0): column 'text' is null" in capsys.readouterr().err
