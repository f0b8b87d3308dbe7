"""training/data.py: tokenizers, corpora, and the layout-invariant loader (single process)."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from meshtrain.training.config import ConfigError
from meshtrain.training.data import (
    ByteTokenizer,
    DataLoader,
    build_dataloader,
    build_tokenizer,
    iter_documents,
    load_tokens,
)

SEQ = 16


@pytest.fixture
def corpus(tmp_path):
    """A small directory corpus: text files and a jsonl, ~10K bytes in all."""
    (tmp_path / "a.txt").write_text("alpha " * 300)
    (tmp_path / "b.md").write_text("# beta\n" + "béta ünïcode " * 200)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("print('gamma')\n" * 150)
    (tmp_path / "sub" / "ignored.bin").write_bytes(b"\x00" * 1000)
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"record {i} " * 20, "id": i}) + "\n")
    return tmp_path


@pytest.fixture
def tokens():
    return torch.arange(40 * (SEQ + 1), dtype=torch.int32)  # 40 windows, every token distinct


def loader(tokens, *, dp_rank=0, dp_size=1, local=8, global_bs=8, seed=0):
    return DataLoader(tokens, seq_len=SEQ, global_batch_size=global_bs, local_batch_size=local,
                      dp_rank=dp_rank, dp_size=dp_size, seed=seed)


def stitched(tokens, step, *, dp_size, local, global_bs=8):
    """Every rank's micro-batches of one step, concatenated in rank then micro-batch order."""
    parts = [loader(tokens, dp_rank=r, dp_size=dp_size, local=local, global_bs=global_bs).batch(step)
             for r in range(dp_size)]
    mbs = [mb for rank in parts for mb in rank]
    return torch.cat([i for i, _ in mbs]), torch.cat([l for _, l in mbs]), mbs


@pytest.mark.parametrize("dp_size,local", [(1, 8), (2, 4), (4, 2), (2, 2), (2, 1), (4, 1)])
def test_shards_partition_global_batch(tokens, dp_size, local):
    ref_in, ref_lab = loader(tokens).global_batch(3)
    inputs, labels, mbs = stitched(tokens, 3, dp_size=dp_size, local=local)
    assert len(mbs) == dp_size * (8 // (dp_size * local))
    assert all(i.shape == (local, SEQ) and i.dtype == torch.int64 for i, _ in mbs)
    assert torch.equal(inputs, ref_in) and torch.equal(labels, ref_lab)
    firsts = inputs[:, 0].tolist()  # tokens are distinct, so a window is known by its first token
    assert len(set(firsts)) == len(firsts)  # no window twice: shards are disjoint


def test_layout_invariance(tokens):
    for step in range(6):  # 40 windows / 8 per step: crosses into a second epoch
        ref = stitched(tokens, step, dp_size=4, local=2)[0]
        assert torch.equal(stitched(tokens, step, dp_size=2, local=1)[0], ref)
        assert torch.equal(stitched(tokens, step, dp_size=1, local=8)[0], ref)


def test_same_dp_rank_same_batches(tokens):
    a, b = loader(tokens, dp_rank=1, dp_size=2, local=2), loader(tokens, dp_rank=1, dp_size=2, local=2)
    for step in (0, 1, 7):
        assert all(torch.equal(x[0], y[0]) for x, y in zip(a.batch(step), b.batch(step)))


def test_seed_determinism(tokens):
    same = [loader(tokens, seed=5).global_batch(s)[0] for s in range(3)]
    again = [loader(tokens, seed=5).global_batch(s)[0] for s in range(3)]
    other = [loader(tokens, seed=6).global_batch(s)[0] for s in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(same, again))
    assert not all(torch.equal(x, y) for x, y in zip(same, other))


def test_labels_shift_and_eos_between_documents(corpus):
    tok = ByteTokenizer()
    stream = load_tokens("text", str(corpus), "byte")
    docs = list(iter_documents("text", str(corpus)))
    assert (stream == tok.eos_id).sum() == len(docs) - 1
    assert tok.decode(stream) == "".join(docs)
    dl = DataLoader(stream, seq_len=SEQ, global_batch_size=4, local_batch_size=4,
                    dp_rank=0, dp_size=1, seed=0)
    inputs, labels = dl.global_batch(0)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    windows = stream[: dl.num_windows * (SEQ + 1)].view(-1, SEQ + 1).long()
    for i, l in zip(inputs, labels):  # each row is a whole window, split into input and label
        assert any(torch.equal(torch.cat([i, l[-1:]]), w) for w in windows)


def test_epoch_wraparound(tokens):
    dl = loader(tokens, global_bs=24, local=24)  # 40 windows: step 1 spans epochs 0 and 1
    epoch0 = torch.cat([dl.global_batch(0)[0], dl.global_batch(1)[0][:16]])[:, 0]
    assert sorted(epoch0.tolist()) == [w * (SEQ + 1) for w in range(40)]  # epoch 0: each window once
    epoch1 = torch.cat([dl.global_batch(1)[0][16:], dl.global_batch(2)[0], dl.global_batch(3)[0][:8]])
    assert sorted(epoch1[:, 0].tolist()) == [w * (SEQ + 1) for w in range(40)]
    assert not torch.equal(epoch0, epoch1[:, 0])  # a fresh permutation per epoch
    assert dl.batch(100)[0][0].shape == (24, SEQ)


def test_state_dict_resume(tokens):
    dl = loader(tokens, dp_size=2, local=2)
    dl.batch(0), dl.batch(1)
    expected = dl.batch(2)
    resumed = loader(tokens, dp_size=2, local=4)  # a resume may change the local layout
    resumed.load_state_dict({**dl.state_dict(), "position": 2})
    assert torch.equal(torch.cat([i for i, _ in resumed.next_batch()]),
                       torch.cat([i for i, _ in expected]))
    assert resumed.state_dict()["position"] == 3
    with pytest.raises(ConfigError, match="seed"):
        loader(tokens, seed=1).load_state_dict(dl.state_dict())


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two", "meta": 1}\n')
    assert list(iter_documents("text", str(path))) == ["one", "two"]
    path.write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(ConfigError, match=r"x\.jsonl:2.*'text'"):
        list(iter_documents("text", str(path)))


def test_bad_arguments(tokens, tmp_path):
    with pytest.raises(ConfigError, match="'stdlib' or 'text'"):
        list(iter_documents("wikipedia", ""))
    with pytest.raises(ConfigError, match="file or directory"):
        list(iter_documents("text", str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"2 \* 3 = 6"):
        loader(tokens, dp_size=2, local=3)
    with pytest.raises(ConfigError, match="corpus too small"):
        loader(tokens, global_bs=48, local=48)
    with pytest.raises(ConfigError, match="no file at"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🚀 ok"
    ids = tok.encode(text)
    assert ids.dtype == torch.int32 and int(ids.max()) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist() + [tok.eos_id]) == text  # special tokens decode to nothing
    assert tok.encode("").numel() == 0 and tok.vocab_size == 258


def test_build_dataloader(corpus):
    cfg = SimpleNamespace(seq_len=SEQ, global_batch_size=8, local_batch_size=0, seed=0,
                          dataset="text", dataset_path=str(corpus), tokenizer="byte")
    dl, tok = build_dataloader(cfg, dp_rank=1, dp_size=2)
    assert isinstance(tok, ByteTokenizer) and dl.grad_accum_steps == 1
    assert dl.batch(0)[0][0].shape == (4, SEQ)
    cfg.local_batch_size = 1
    assert build_dataloader(cfg, dp_rank=0, dp_size=2)[0].grad_accum_steps == 4
    cfg.global_batch_size = 7
    with pytest.raises(ValueError, match="multiple"):
        build_dataloader(cfg, dp_rank=0, dp_size=2)


def test_stdlib_corpus():
    cfg = SimpleNamespace(seq_len=64, global_batch_size=8, local_batch_size=2, seed=0,
                          dataset="stdlib", dataset_path="", tokenizer="byte")
    dl, tok = build_dataloader(cfg, dp_rank=0, dp_size=2)
    assert len(dl.tokens) > 1_000_000
    assert load_tokens("stdlib") is dl.tokens  # built once per process
    inputs, _ = dl.batch(0)[0]
    assert inputs.shape == (2, 64) and int(inputs.max()) < tok.vocab_size


def test_hf_tokenizer_needs_package(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what Python does when it is not installed
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer(str(path))


def test_hf_tokenizer_eos_choice(tmp_path, monkeypatch):
    """The EOS lookup order, against a stand-in for tokenizers.Tokenizer."""
    import sys
    from meshtrain.training.data import HFTokenizer

    class FakeTokenizer:
        vocab = {}

        @classmethod
        def from_file(cls, path):
            return cls()

        def get_vocab_size(self, with_added_tokens=True):
            return 1000

        def token_to_id(self, name):
            return self.vocab.get(name)

    monkeypatch.setitem(sys.modules, "tokenizers", SimpleNamespace(Tokenizer=FakeTokenizer))
    FakeTokenizer.vocab = {"<|endoftext|>": 7, "</s>": 2, "<s>": 1}
    tok = HFTokenizer("tokenizer.json")
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (2, 1, 1000)
    FakeTokenizer.vocab = {}
    assert HFTokenizer("tokenizer.json").eos_id == 999


def test_a_file_that_is_not_a_tokenizer_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(str(path))
