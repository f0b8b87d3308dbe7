"""[training] document_masking: sft records packed several to a sequence train exactly as
if each were alone in its own sequence.

The references run the records one at a time, unpacked, through models meshtrain did
not change for this: the native Llama called without positions (one document per
sequence, causal SDPA as before), and transformers' own Qwen2ForCausalLM /
LlamaForCausalLM. Which records a packed sequence holds, and which of their tokens are
trained, is read from the records' own bytes (as tests/test_sft.py's reference_labels does), not
from meshtrain's packing code. Each reference loss is F.cross_entropy summed over the
response tokens, divided by their count in the whole batch.

Plants (run by hand, each fails the tests named):
- models/documents.py's document_mask returning the plain causal mask: the Llama (plain,
  checkpointed, compiled), GPT-2 and Llama bitwise-isolation tests (the Hugging Face
  models mask by themselves);
- models/hf/model.py's forward not passing position_ids (transformers then sees one
  document): both Hugging Face equality tests and the Qwen2 bitwise-isolation test;
- training/sft.py's sequence counting positions on across records (no reset, and so no
  boundary either): every fast test here;
- GPT-2 looking up positions 0..s-1 with the mask kept: the GPT-2 test. The same plant
  in the Llama (rotary tables by 0..s-1) fails nothing, and cannot: rotary attention
  depends only on the distance between two positions, and the mask already keeps
  records apart. A learned position table can tell;
- training/step.py's pipeline step not passing positions to the schedule: the layouts
  test, at its first pipeline layout.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_sft import IGNORE, loader, records, write_jsonl

def canonical(name: str) -> str:
    """A parameter's name without the wrappers' parts (checkpoint_wrapper, torch.compile)."""
    from meshtrain.parallel.init import canonical_name

    return canonical_name(name)


SEQ_LEN = 127  # positions up to 126: inside the tiny models' 128-row tables


def records_in(buf: np.ndarray, rows: list[dict], pad: int = 257) -> list[tuple[bytes, bytes]]:
    """(prompt bytes, response bytes) of each record in a packed sequence, in order, found by
    the tag each prompt starts with (as tests/test_sft.py's reference_labels)."""
    by_tag = {r["prompt"].split(":")[0].encode(): r for r in rows}
    found, pos = [], 0
    while pos < len(buf) and buf[pos] != pad:
        tag = bytes(buf[pos:pos + 8].tolist()).split(b":")[0]
        p, r = (by_tag[tag][k].encode() for k in ("prompt", "response"))
        assert bytes(buf[pos:pos + len(p) + len(r)].tolist()) == p + r, "a record is not whole in its sequence"
        found.append((p, r))
        pos += len(p) + len(r)
    return found


def alone_token_losses(forward, bufs: np.ndarray, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, counted), [len(bufs), seq_len] each: the cross-entropy of ``forward(tokens)``
    (logits of one record, [1, n] -> [1, n, vocab]) run on each record alone, put where
    that token is an input of the packed sequence (0 on prompts, padding and each record's
    last token, whose next token is another record's), and where a loss is counted."""
    losses, counted = [], []
    for buf in bufs:
        pieces, keep = [], []
        for p, r in records_in(buf, rows):
            tokens = torch.tensor(list(p + r))[None]
            labels = torch.tensor([IGNORE] * len(p) + list(r))
            labels[0] = IGNORE  # a record's first token has nothing before it to be predicted from
            logits = forward(tokens)[0]
            pieces += [F.cross_entropy(logits[:-1].float(), labels[1:], reduction="none", ignore_index=IGNORE),
                       torch.zeros(1)]
            keep += [labels[1:] != IGNORE, torch.zeros(1, dtype=torch.bool)]
        pad = len(buf) - sum(len(k) for k in keep)
        losses.append(torch.cat(pieces + [torch.zeros(pad)])[:-1])  # seq_len + 1 tokens, seq_len inputs
        counted.append(torch.cat(keep + [torch.zeros(pad, dtype=torch.bool)])[:-1])
    return torch.stack(losses), torch.stack(counted)


def each_record_alone(forward, bufs: np.ndarray, rows: list[dict]) -> torch.Tensor:
    """The mean over the batch's counted tokens of `alone_token_losses`."""
    losses, counted = alone_token_losses(forward, bufs, rows)
    return losses.sum() / counted.sum()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(rows, loader with document masking): 2 micro-batches of 2 packed sequences."""
    rows = records(60, seed=7)
    path = write_jsonl(tmp_path_factory.mktemp("docmask") / "a.jsonl", rows)
    data = loader(path, seq_len=SEQ_LEN, global_batch_size=4, local_batch_size=2, document_masking=True)
    held = [len(records_in(b, rows)) for b in data.global_sequences(0)[0]]
    assert min(held) >= 2 and held[0] >= 3, held  # several records a sequence
    return rows, data


def native_llama():
    from meshtrain.models.llama.model import Llama

    torch.manual_seed(0)
    return Llama.from_flavor("debug", vocab_size=258, n_layers=2, max_seq_len=128)


def native_gpt2():
    from meshtrain.models.gpt2.model import GPT2

    return GPT2.from_flavor("debug", vocab_size=258, n_layers=2, max_seq_len=128)


def hf_pair(tmp_path, arch: str):
    """(meshtrain's model of a tiny config, transformers' own class with the same weights)."""
    from meshtrain.models.hf.model import build_hf
    from tests.hf_configs import write_config
    from tests.train_oracle import plain_transformers_model

    shape = build_hf(str(write_config(tmp_path / arch, arch)))
    ours = copy.deepcopy(shape)
    ours.init_weights(seed=0, device="cpu")
    return ours, plain_transformers_model(shape, 0)


def packed_step(model, data):
    """train_step over step 0's packed micro-batches: (loss, {name: grad})."""
    from meshtrain.training.step import train_step

    loss, _ = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), data.batch(0), max_norm=0.0)
    return loss, {n: p.grad for n, p in model.named_parameters()}


def assert_same(loss, grads, want_loss, reference):
    assert abs(loss - want_loss.item()) <= 1e-5 * want_loss.item(), (loss, want_loss.item())
    want_loss.backward()
    # atol on the scale of the whole gradient: some are zero in exact arithmetic (a key
    # bias shifts every score of a row alike) and only rounding noise either way.
    scale = max(p.grad.abs().max() for p in reference.parameters())
    for name, p in reference.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6 * scale), name


def test_positions_restart_at_every_record(packed):
    rows, data = packed
    bufs, _, positions = data.global_sequences(0, positions=True)
    inputs, labels, got = data.global_batch(0)
    assert torch.equal(got, torch.from_numpy(positions[:, :-1]))
    for buf, pos in zip(bufs, got):
        want = [i for p, r in records_in(buf, rows) for i in range(len(p + r))]
        assert pos[:len(want)].tolist() == want
        assert pos[len(want)] == 0, "the padding starts a document of its own"
    assert all(len(mb) == 3 for mb in data.batch(0)), "each micro-batch carries its positions"


def test_packed_llama_equals_each_record_alone_through_the_plain_llama(packed):
    rows, data = packed
    model = native_llama()
    reference = copy.deepcopy(model)
    loss, grads = packed_step(model, data)
    want = each_record_alone(reference, data.global_sequences(0)[0], rows)  # no positions: plain causal
    assert_same(loss, grads, want, reference)


@pytest.mark.parametrize("ac,compiled", [("full", False), ("op", True)])
def test_packed_llama_with_checkpointed_or_compiled_blocks_equals_each_record_alone(packed, ac, compiled):
    """The blocks wrapped as [activation_checkpoint] / [compile] wrap them: the mask and the
    per-token rotary angles go through checkpoint_wrapper and torch.compile(fullgraph)."""
    from meshtrain.parallel.activation_checkpoint import apply_ac, apply_compile

    rows, data = packed
    model = native_llama()
    reference = copy.deepcopy(model)
    apply_ac(model.layers, ac)
    if compiled:
        apply_compile(model.layers)
    loss, grads = packed_step(model, data)
    want = each_record_alone(reference, data.global_sequences(0)[0], rows)
    assert_same(loss, {canonical(n): g for n, g in grads.items()}, want, reference)


def test_packed_gpt2_equals_each_record_alone(packed):
    """GPT-2's learned positions: a record's tokens look up rows 0, 1, ... wherever it sits."""
    rows, data = packed
    model = native_gpt2()
    reference = copy.deepcopy(model)
    loss, grads = packed_step(model, data)
    want = each_record_alone(reference, data.global_sequences(0)[0], rows)
    assert_same(loss, grads, want, reference)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_hf_model_equals_transformers_on_each_record_alone(packed, tmp_path, arch):
    rows, data = packed
    ours, plain = hf_pair(tmp_path, arch)
    loss, grads = packed_step(ours, data)
    want = each_record_alone(lambda t: plain(input_ids=t).logits, data.global_sequences(0)[0], rows)
    assert_same(loss, grads, want, plain)


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_changing_one_record_leaves_every_other_records_logits_bitwise_unchanged(packed, tmp_path, which):
    rows, data = packed
    model = native_llama() if which == "llama" else hf_pair(tmp_path, which)[0]
    inputs, _, positions = data.global_batch(0)
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    a, b = starts[1], starts[2]  # the second record of the first sequence
    changed = inputs.clone()
    changed[0, a:b] = torch.randint(0, 256, (b - a,), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(changed, inputs)
    with torch.no_grad():
        before, after = (model(x, positions=positions) for x in (inputs, changed))
        before, after = (getattr(o, "logits", o) for o in (before, after))
    keep = torch.ones(inputs.shape[:2], dtype=torch.bool)
    keep[0, a:b] = False
    assert torch.equal(before[keep], after[keep]), "another record's logits moved"
    assert not torch.equal(before[0, a:b], after[0, a:b])


def test_without_positions_the_models_run_as_before(packed):
    """positions=None is today's causal path: a packed sequence then attends across records."""
    _, data = packed
    model = native_llama()
    inputs, _, positions = data.global_batch(0)
    with torch.no_grad():
        plain, masked = model(inputs), model(inputs, positions=positions)
        one_document = torch.arange(inputs.shape[1]).expand_as(inputs)
        assert torch.allclose(plain, model(inputs, positions=one_document), atol=1e-5)
    assert not torch.allclose(plain, masked, atol=1e-3)


# ---------------------------------------------------------------- pretraining streams

EOS = 257  # the byte tokenizer's, between the documents of a stream


def short_documents(n: int, seed: int) -> list[str]:
    """Documents of 5 to 60 characters: a window of 128 tokens holds several."""
    g = np.random.default_rng(seed)
    return [f"doc{i}:" + "".join(g.choice(list("abcdefgh ,."), size=int(g.integers(1, 55)))) for i in range(n)]


def stream_loader(path, dataset: str, *, document_masking: bool):
    import types

    from meshtrain.training.data import build_dataloader

    c = types.SimpleNamespace(dataset=dataset, dataset_path=str(path), tokenizer="byte", seq_len=SEQ_LEN,
                              global_batch_size=4, local_batch_size=2, seed=3, document_masking=document_masking)
    return build_dataloader(c, dp_rank=0, dp_size=1)[0]


@pytest.fixture(scope="module", params=["text", "tokens"])
def stream(request, tmp_path_factory):
    """(raw windows [G, seq_len + 1] of step 0, loader with document masking): a jsonl corpus
    of short documents, tokenized at start-up ("text") or prepared by prepare-data
    ("tokens", whose EOS id is its index's). The raw windows come from the same loader
    without masking: the windows and order of today's causal stream."""
    from meshtrain.training import prepare_data

    root = tmp_path_factory.mktemp("stream")
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in short_documents(400, seed=5)))
    if request.param == "tokens":
        prepare_data.prepare([str(path)], str(root / "prepared"), workers=1)
        path = root / "prepared"
    inputs, labels = stream_loader(path, request.param, document_masking=False).global_batch(0)
    windows = torch.cat([inputs, labels[:, -1:]], dim=1)
    assert all(int((w == EOS).sum()) >= 2 for w in windows)  # several documents a window
    return windows, stream_loader(path, request.param, document_masking=True)


def documents_alone_token_losses(forward, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, counted) [G, seq_len]: each window cut into its documents -- a piece ends
    with its EOS, or at the window's end -- and each piece run alone through ``forward``;
    a piece's tokens predict the next ones of the same piece and nothing else (an EOS
    predicts nothing: what follows it is another document)."""
    losses, counted = [], []
    for w in windows.tolist():
        pieces, start = [], 0
        for i, t in enumerate(w):
            if t == EOS or i == len(w) - 1:
                pieces.append(w[start:i + 1])
                start = i + 1
        row, keep = [], []
        for piece in pieces:
            if len(piece) > 1:
                tokens = torch.tensor(piece)[None]
                row.append(F.cross_entropy(forward(tokens)[0, :-1].float(), tokens[0, 1:], reduction="none"))
                keep.append(torch.ones(len(piece) - 1, dtype=torch.bool))
            row.append(torch.zeros(1))  # the piece's last token predicts the next piece's first
            keep.append(torch.zeros(1, dtype=torch.bool))
        losses.append(torch.cat(row)[:-1])  # the window's last token is a label only
        counted.append(torch.cat(keep)[:-1])
    return torch.stack(losses), torch.stack(counted)


def test_stream_positions_restart_after_every_eos_and_eos_predicts_nothing(stream):
    windows, data = stream
    inputs, labels, positions = data.global_batch(0)
    assert torch.equal(inputs, windows[:, :-1])
    for w, lab, pos in zip(windows.tolist(), labels.tolist(), positions.tolist()):
        want_pos, want_lab, p = [], [], 0
        for i in range(len(w) - 1):
            want_pos.append(p)
            want_lab.append(IGNORE if w[i] == EOS else w[i + 1])
            p = 0 if w[i] == EOS else p + 1
        assert pos == want_pos and lab == want_lab
    assert all(len(mb) == 3 for mb in data.batch(0)), "each micro-batch carries its positions"


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_stream_with_document_masking_equals_each_document_alone(stream, which):
    """The training step on masked windows: loss and gradients of each document run alone,
    unpacked, through the plain model. Fails with the mask or the position reset removed
    (GPT-2's learned positions), and with the EOS label kept (the count differs)."""
    windows, data = stream
    model = native_llama() if which == "llama" else native_gpt2()
    reference = copy.deepcopy(model)
    loss, grads = packed_step(model, data)
    losses, counted = documents_alone_token_losses(reference, windows)
    assert_same(loss, grads, losses.sum() / counted.sum(), reference)


def test_stream_document_masking_is_off_by_default_for_pretraining_and_on_for_sft():
    from meshtrain.training.config_loader import config_to_toml, load_config

    masking = lambda *flags: load_config("debug_2d", list(flags)).training.document_masking  # noqa: E731
    assert masking() is False and masking("--training.dataset=text") is False
    assert masking("--training.dataset=sft") is True
    assert masking("--training.dataset=sft", "--training.document_masking=false") is False
    assert masking("--training.document_masking=true") is True
    cfg = load_config("debug_2d", ["--training.dataset=sft"])  # a saved config reads back the same
    assert "document_masking = true" in config_to_toml(cfg)


# ---------------------------------------------------------------- every layout, one job

BASE = ["--training.dataset=sft", "--training.document_masking=true", "--training.steps=1",
        f"--training.seq_len={SEQ_LEN + 1}", "--training.global_batch_size=8", "--training.max_norm=0",
        "--validation.enable=true", "--validation.dataset=sft", "--validation.steps=1"]
LAYOUTS = {  # name -> (model flags, layout flags); 4 processes each
    "dp2_tp2": ("llama", ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
    "cp2_dp2": ("llama", ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"]),
    "cp2_tp2": ("llama", ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2"]),
    "pp2_dp2_accum": ("llama", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                                "--training.local_batch_size=2"]),
    "pp2_interleaved_tp2": ("llama", ["--parallelism.pp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2",
                                      "--parallelism.pp_schedule=Interleaved1F1B"]),
    "hf_dp2_tp2": ("qwen2", ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
    "hf_pp2_dp2": ("qwen2", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                             "--parallelism.pp_schedule=GPipe"]),
    # A pretraining stream of short documents, cut at each EOS, across the cp split of the sequence.
    "text_cp2_tp2": ("llama", ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2"]),
}


def layout_argv(root, name: str) -> list[str]:
    model, flags = LAYOUTS[name]
    config = (["--config", "debug_2d"] if model == "llama" else
              ["--config", "hf_debug", f"--model.hf_config={root / 'qwen2'}"])
    data = root / ("docs.jsonl" if name.startswith("text") else "records.jsonl")
    kind = ["--training.dataset=text", "--validation.dataset=text"] if name.startswith("text") else []
    return [*config, *BASE, *kind, f"--training.dataset_path={data}", f"--validation.dataset_path={data}", *flags,
            f"--job.output_dir={root / 'out'}", f"--job.name={name}"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    from tests.forked_ranks import forked_ranks
    from tests.hf_configs import write_config

    root = tmp_path_factory.mktemp("docmask_layouts")
    write_config(root / "qwen2", "qwen2")
    rows = records(120, seed=11)
    write_jsonl(root / "records.jsonl", rows)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in short_documents(300, seed=2)))
    (root / "runs.json").write_text(json.dumps({name: layout_argv(root, name) for name in LAYOUTS}))
    proc = forked_ranks("tests/workers/document_masking_runs.py", str(root), str(root / "runs.json"), nproc=4,
                    timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root, rows, {name: torch.load(root / f"{name}.pt") for name in LAYOUTS}


def one_process_reference(root, rows, name: str):
    """(each records-alone loss over step 0's batch, its gradients by name, the token
    losses and counts) -- the plain model of the run's config with its initial weights:
    the native Llama called without positions, or transformers' own Qwen2ForCausalLM."""
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.data import build_dataloader
    from tests.train_oracle import plain_transformers_model

    config, _ = parse_args(layout_argv(root, name))
    shape = recipe.build_model(config, 258)
    if LAYOUTS[name][0] == "llama":
        plain = copy.deepcopy(shape)
        plain.init_weights(seed=config.training.seed, device="cpu")
        forward = plain
    else:
        plain = plain_transformers_model(shape, config.training.seed)
        forward = lambda t: plain(input_ids=t).logits  # noqa: E731
    if name.startswith("text"):  # the same windows without masking: today's stream, cut by the reference
        config.training.document_masking = False
        inputs, labels = build_dataloader(config.training, dp_rank=0, dp_size=1)[0].global_batch(0)
        losses, counted = documents_alone_token_losses(forward, torch.cat([inputs, labels[:, -1:]], dim=1))
    else:
        data, _ = build_dataloader(config.training, dp_rank=0, dp_size=1)
        losses, counted = alone_token_losses(forward, data.global_sequences(0)[0], rows)
    loss = losses.sum() / counted.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in plain.named_parameters()}, losses.detach(), counted


@pytest.mark.slow
def test_packed_runs_in_every_layout_equal_each_record_alone_in_one_process(layout_runs):
    """dp x tp (sequence and loss parallel), cp 2 with dp and with tp, pp 2 1F1B with
    accumulation, pp 2 Interleaved1F1B x tp 2, and the Hugging Face Qwen2 under dp x tp
    and pp 2 GPipe: the first step's loss and every full gradient equal the records run
    one at a time, unpacked, in one process; the validation loss at the initial weights
    (training/evaluate.py, through the pipeline schedule's forward-only pass where there
    is one) over the same records and seed -- step 0's sequences -- equals the same mean
    over their counted tokens.
    At the initial weights attending across records moves the loss little (about 3e-5
    relative, 3x the tolerance) but the gradients by thousands of times their tolerance.
    Plant (by hand): training/step.py's pipeline step not passing positions to the
    schedule -- fails at pp2_dp2_accum."""
    root, rows, results = layout_runs
    for name, got in results.items():
        want_loss, want_grads, _, _ = one_process_reference(root, rows, name)
        assert abs(got["loss"] - want_loss) <= 1e-5 * want_loss, (name, got["loss"], want_loss)
        assert set(got["grads"]) == set(want_grads), name
        scale = max(g.abs().max() for g in want_grads.values())
        for key, want in want_grads.items():
            assert torch.allclose(got["grads"][key], want, rtol=1e-4, atol=1e-6 * scale), (name, key)
        assert abs(got["val/loss"] - want_loss) <= 1e-5 * want_loss, (name, got["val/loss"], want_loss)


def test_flex_block_mask_allows_exactly_what_the_boolean_mask_allows():
    """CUDA runs packed documents through FlexAttention with document_block_mask; CPU (these
    tests) through SDPA with document_bool_mask. The block mask's rule, expanded to every
    (query, key) pair by torch's own create_mask, equals the boolean mask, and torch's
    eager flex_attention under it equals SDPA under the boolean mask (forward: FlexAttention
    has no CPU backward). bench/gpu_check.py compares the compiled kernels' outputs and
    gradients on a GPU. Fails if the rule lets a query see a later key or another document."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    from meshtrain.models.documents import document_block_mask, document_bool_mask

    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in (5, 40, 1, 90, 120)]).view(2, 128)
    bool_mask = document_bool_mask(positions)
    block = document_block_mask(positions)
    assert torch.equal(create_mask(block.mask_mod, 2, 1, 128, 128, device="cpu"), bool_mask)
    q = torch.randn(2, 4, 128, 16, generator=g)
    k, v = (torch.randn(2, 2, 128, 16, generator=g) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block, enable_gqa=True), ref)
