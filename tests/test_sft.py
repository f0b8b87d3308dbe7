"""[training] dataset = "sft": records -> tokens and labels, packing, bad input, and the
loss -- the mean over the response tokens of the whole global batch -- against
transformers' own *ForCausalLM given ``labels`` with -100 on the prompt.

The references here are written from the records themselves (the bytes of a prompt, the
bytes of a response), never from meshtrain's label code; the loss's is transformers'."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from meshtrain.training.config import ConfigError

IGNORE = -100


def records(n: int, seed: int = 0) -> list[dict]:
    """Prompt/response records of varied lengths; every prompt starts with its own tag, so
    a reference can find each record in a packed sequence by its bytes."""
    g = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "ε", "zeta", "über", "theta"]
    return [{"prompt": f"#{i}: " + " ".join(g.choice(words, g.integers(1, 6))) + " ->",
             "response": " " + " ".join(g.choice(words, g.integers(1, 8))) + "."} for i in range(n)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def cfg(path, **kw):
    base = dict(dataset="sft", dataset_path=str(path), tokenizer="byte", seq_len=96, global_batch_size=8,
                local_batch_size=0, seed=0, chat_template="auto", document_masking=False)
    return types.SimpleNamespace(**{**base, **kw})


def loader(path, dp_rank=0, dp_size=1, **kw):
    from meshtrain.training.data import build_dataloader

    return build_dataloader(cfg(path, **kw), dp_rank=dp_rank, dp_size=dp_size)[0]


def reference_labels(buf: np.ndarray, rows: list[dict], pad: int = 257) -> np.ndarray:
    """Labels as transformers takes them (not shifted): a response's bytes where they are,
    -100 on prompts and padding. Found by matching each record's bytes in the sequence."""
    by_tag = {r["prompt"].split(":")[0].encode(): r for r in rows}
    labels, pos = np.full(len(buf), IGNORE), 0
    while pos < len(buf) and buf[pos] != pad:
        tag = bytes(buf[pos:pos + 8].tolist()).split(b":")[0]
        p, r = (by_tag[tag][k].encode() for k in ("prompt", "response"))
        assert bytes(buf[pos:pos + len(p) + len(r)].tolist()) == p + r, "a record is not whole in its sequence"
        labels[pos + len(p):pos + len(p) + len(r)] = list(r)
        pos += len(p) + len(r)
    return labels


# ---------------------------------------------------------------- records -> sequences

def test_a_prompt_response_record_is_its_bytes_and_only_the_response_is_labelled(tmp_path):
    """Plant (by hand): the loss mask all ones in training/sft.py's encode (no -100 on the
    prompt) -- the labels then differ from the reference's."""
    rows = records(40)
    data = loader(write_jsonl(tmp_path / "a.jsonl", rows))
    for step in range(3):
        bufs, _ = data.global_sequences(step)
        inputs, labels = data.global_batch(step)
        for buf, x, y in zip(bufs, inputs, labels):
            want = reference_labels(buf, rows)
            assert torch.equal(x, torch.from_numpy(buf[:-1]))
            assert torch.equal(y, torch.from_numpy(want[1:])), "labels are the next token where it is a response"


def test_records_are_packed_whole_and_each_appears_once_an_epoch(tmp_path):
    rows = records(60, seed=1)
    data = loader(write_jsonl(tmp_path / "a.jsonl", rows), global_batch_size=2, seq_len=192)
    n = data.num_windows
    assert n * 193 < 1.5 * sum(len((r["prompt"] + r["response"]).encode()) for r in rows), "packing wastes space"
    seen = []
    for i in range(n):
        buf, _ = data.sequences(torch.tensor([i]))
        labels = reference_labels(buf[0], rows)  # asserts every record in it is whole
        seen += [t for t in bytes(buf[0][buf[0] < 256].tolist()).split(b"#")[1:]]
        assert (labels[buf[0] == 257] == IGNORE).all()
    assert sorted(int(t.split(b":")[0]) for t in seen) == list(range(60))


def test_every_layout_reads_the_same_sequences(tmp_path):
    """dp 4 x 1 micro-batch, dp 2 x 2 micro-batches and dp 1 read the same global batch."""
    path = write_jsonl(tmp_path / "a.jsonl", records(50))
    whole = loader(path).global_batch(2)
    for dp, local in ((4, 0), (2, 2)):
        parts = [loader(path, rank, dp, local_batch_size=local).batch(2) for rank in range(dp)]
        inputs = torch.cat([x for part in parts for x, _ in part])
        labels = torch.cat([y for part in parts for _, y in part])
        assert torch.equal(inputs, whole[0]) and torch.equal(labels, whole[1])


def test_a_response_longer_than_a_sequence_is_cut_with_a_warning(tmp_path):
    rows = records(20) + [{"prompt": "#99: long ->", "response": " x" * 100}]
    with pytest.warns(UserWarning, match=r"1 of 21 records are longer than seq_len \+ 1 = 97 tokens; each is cut"):
        data = loader(write_jsonl(tmp_path / "a.jsonl", rows))
    assert data.lengths.max() == 97 and (data.lengths[:20] < 97).all()


def test_messages_with_the_plain_template_train_on_assistant_turns_only(tmp_path):
    convo = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}]}
    data = loader(write_jsonl(tmp_path / "c.jsonl", [convo] * 8), seq_len=127, global_batch_size=1)
    buf, _ = data.global_sequences(0)
    inputs, labels = data.global_batch(0)
    text = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello\n<|user|>\n2+2?\n<|assistant|>\n4\n"
    assert bytes(buf[0][:len(text.encode())].tolist()).decode() == text
    trained = bytes(t for t in labels[0].tolist() if t != IGNORE).decode()
    assert trained == "hello\n4\n"


def hf_tokenizer_folder(folder, with_template: bool = True):
    """A byte-level BPE tokenizer.json with no merges (every byte a token) and ChatML
    specials, with a chat template in tokenizer_config.json when ``with_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if with_template:
        config["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder / "tokenizer.json")


def test_messages_use_the_tokenizers_own_chat_template(tmp_path):
    """The sequence is transformers' rendering of the conversation; the trained tokens are
    exactly each assistant turn's content and its end marker."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    spec = hf_tokenizer_folder(tmp_path / "tok")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    data = loader(write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}] * 4), tokenizer=spec, global_batch_size=1,
                  seq_len=200)
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    buf, _ = data.global_sequences(0)
    inputs, labels = data.global_batch(0)
    rendered = hf.apply_chat_template(msgs, tokenize=False)
    assert hf.decode(buf[0][:len(hf(rendered)["input_ids"])].tolist()) == rendered
    trained = hf.decode([t for t in labels[0].tolist() if t != IGNORE])
    assert trained.startswith("hello<|im_end|>\nciao<|im_end|>\n")


# ---------------------------------------------------------------- bad input

def test_a_record_without_a_response_is_refused_with_its_file_and_line(tmp_path):
    rows = records(3)
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ConfigError, match=rf'{path}:4: record has no "response"'):
        loader(path)
    (tmp_path / "b.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'b.jsonl'}:1: the conversation has no assistant turn"):
        loader(tmp_path / "b.jsonl")


def test_a_malformed_json_line_is_refused_with_its_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(records(1)[0]) + '\n{"prompt": "q", "response": \n')
    with pytest.raises(ConfigError, match=rf"{path}:2: not valid JSON"):
        loader(path)


def test_a_chat_template_the_tokenizer_lacks_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", records(8))
    with pytest.raises(ConfigError, match='chat_template = "tokenizer", but the byte tokenizer has none'):
        loader(path, chat_template="tokenizer")
    spec = hf_tokenizer_folder(tmp_path / "tok", with_template=False)
    with pytest.raises(ConfigError, match=r'chat_template = "tokenizer", but no chat_template in .*tokenizer_config'):
        loader(path, tokenizer=spec, chat_template="tokenizer")


# ---------------------------------------------------------------- prepared once, memory-mapped

def test_a_prepared_folder_gives_the_sequences_of_the_jsonl(tmp_path):
    """`meshtrain prepare-data --kind sft` (two workers, two input files): the memory-mapped
    folder reads the same batches as the records tokenized at start-up."""
    from meshtrain.training.prepare_data import main

    rows = records(70)
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", rows[:30])
    write_jsonl(tmp_path / "in" / "b.jsonl", rows[30:])
    assert main([str(tmp_path / "in"), "--kind", "sft", "--out", str(tmp_path / "out"), "--workers", "2"]) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["num_records"] == 70
    prepared, fresh = loader(tmp_path / "out"), loader(tmp_path / "in")
    assert isinstance(prepared.tokens.tokens, np.ndarray) and not prepared.tokens.tokens.flags.owndata  # mapped
    for step in range(3):
        for a, b in zip(prepared.global_batch(step), fresh.global_batch(step)):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- the loss

def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, num_hidden_layers=1, vocab_size=258,
                                        max_position_embeddings=128, tie_word_embeddings=False,
                                        initializer_range=0.5,  # peaked logits: token losses differ widely
                                        attn_implementation="eager"))


def test_the_step_loss_is_transformers_mean_over_the_response_tokens_of_the_batch(tmp_path):
    """One process, two micro-batches that hold different numbers of response tokens:
    train_step's loss and gradients equal one forward of transformers' LlamaForCausalLM
    over the whole batch with labels -100 on prompts and padding. The mean of the
    micro-batches' own means (what step.py did before) is a different number.
    Plant (by hand): train_step's loss back to cross_entropy(model(inputs), labels) /
    len(micro_batches), the mean per micro-batch -- this test fails."""
    from meshtrain.training.step import train_step

    rows = records(40, seed=3)
    data = loader(write_jsonl(tmp_path / "a.jsonl", rows), global_batch_size=4, local_batch_size=2)
    micro = data.batch(0)
    counts = [int((y != IGNORE).sum()) for _, y in micro]
    assert counts[0] != counts[1], counts
    bufs, _ = data.global_sequences(0)
    labels = torch.from_numpy(np.stack([reference_labels(b, rows) for b in bufs]))

    reference = tiny_llama()
    out = reference(input_ids=torch.from_numpy(bufs), labels=labels)  # transformers' own loss
    out.loss.backward()
    ours = tiny_llama()
    loss, _ = train_step(ours, torch.optim.SGD(ours.parameters(), lr=0.0), micro, max_norm=0.0)
    assert abs(loss - out.loss.item()) <= 1e-5 * out.loss.item(), (loss, out.loss.item())
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * q.grad.abs().max()), name

    with torch.no_grad():  # the per-micro-batch mean, averaged over the micro-batches
        per_micro = [torch.nn.functional.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten())
                     for x, y in micro]
    old = sum(per_micro).item() / len(per_micro)
    assert abs(old - out.loss.item()) > 100 * 1e-5 * out.loss.item(), "the micro-batches do not tell them apart"


def test_pretraining_labels_count_every_token(tmp_path):
    """No -100: the step's loss is the plain mean cross-entropy, as before."""
    from meshtrain.training.step import train_step

    model = tiny_llama()
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss, _ = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         [(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])], max_norm=0.0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss - want.item()) <= 1e-6 * want.item()


# ---------------------------------------------------------------- every layout, one job

SFT_LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4", "--parallelism.tp=1"],
    "fsdp4_accum": ["--parallelism.dp_shard=4", "--parallelism.tp=1", "--training.local_batch_size=1"],
    "dp2_tp2": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "pp2_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
    "pp2_dp2_accum": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                      "--training.local_batch_size=2"],
}


def sft_argv(root, layout: str) -> list[str]:
    return ["--config", "hf_debug", f"--model.hf_config={root / 'qwen2'}", "--training.dataset=sft",
            f"--training.dataset_path={root / 'records.jsonl'}", "--training.document_masking=false",
            "--training.steps=1", "--training.seq_len=96", "--training.global_batch_size=8",
            "--training.max_norm=0", *SFT_LAYOUTS[layout], f"--job.output_dir={root / 'out'}", f"--job.name={layout}"]


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    from tests.conftest import recipe_runs
    from tests.hf_configs import write_config

    root = tmp_path_factory.mktemp("sft_layouts")
    write_config(root / "qwen2", "qwen2")
    rows = records(120, seed=5)
    write_jsonl(root / "records.jsonl", rows)
    return root, rows, recipe_runs(root, {name: sft_argv(root, name) for name in SFT_LAYOUTS}, nproc=4)


@pytest.fixture(scope="module")
def transformers_step(sft_runs):
    """transformers' own Qwen2ForCausalLM with meshtrain's initial weights, one forward
    over the whole global batch, labels -100 on prompts and padding: (loss, gradients)."""
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.data import build_dataloader
    from tests import train_oracle

    root, rows, _ = sft_runs
    config, _ = parse_args(sft_argv(root, "fsdp4"))
    plain = train_oracle.plain_transformers_model(recipe.build_model(config, 258), config.training.seed)
    data, _ = build_dataloader(config.training, dp_rank=0, dp_size=1)
    bufs, _ = data.global_sequences(0)
    labels = torch.from_numpy(np.stack([reference_labels(b, rows) for b in bufs]))
    loss = plain(input_ids=torch.from_numpy(bufs), labels=labels).loss
    loss.backward()
    return loss.item(), {name: p.grad for name, p in plain.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SFT_LAYOUTS))
def test_sft_loss_and_gradients_equal_transformers_in_every_layout(sft_runs, transformers_step, layout):
    """FSDP 4 (with and without gradient accumulation), dp 2 x tp 2 (loss_parallel), pp 2 x
    dp 2 with 1F1B (with and without accumulation): the first step's loss and every full
    gradient equal transformers' over the global batch.
    Plants (run by hand): training/step.py's token_loss_scale without its all-reduce (each
    rank divides by its own count); training/sft.py's encode with the loss mask all ones
    (no -100 on the prompt). Each fails this test."""
    _, rows, results = sft_runs
    want_loss, want_grads = transformers_step
    got = results[layout]
    assert abs(got["losses"][0] - want_loss) <= 1e-5 * want_loss, (layout, got["losses"][0], want_loss)
    assert set(got["grads"]) == set(want_grads)
    for name, want in want_grads.items():
        assert torch.allclose(got["grads"][name], want, rtol=1e-4, atol=1e-5 * want.abs().max()), (layout, name)
