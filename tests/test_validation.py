"""[validation] and `meshtrain evaluate`, judged by things meshtrain did not write.

- The validation loss of six layouts (FSDP, dp x tp with loss_parallel, HSDP with
  accumulation, cp 2, pp 2 GPipe x dp 2, pp 2 Interleaved1F1B x tp 2), all in one four-process
  job, equals `F.cross_entropy` of a plain nn.Module holding that run's weights over the
  same held-out batches. Plants this catches (each run once by hand): the per-rank means
  summed over dp instead of averaged; the cp ranks' means left un-averaged; the validation
  loader reading the training part instead of the held-out tail.
- train.py with validation on trains bitwise like train.py with it off -- losses, gradient
  norms, and every tensor of the final checkpoint (weights, optimizer state, RNG) -- and
  resumes bitwise, having read only the data before the held-out tail. Plants this
  catches: evaluation calling the optimizer's step; evaluation drawing from torch's
  generator (as dropout would) without restoring it; train.py not holding the tail out.
- `meshtrain evaluate` on the run's last checkpoint gives the in-run final evaluation's
  number (same layout: exactly; one process: within fp32 rounding).
- On fine-tuning records (dataset = "sft", a held-out split of whole records) the
  validation loss is the mean over the counted (response) tokens of all its batches:
  it equals transformers' own *ForCausalLM given the held-out sequences with -100 labels,
  in one process (fast) and in four layouts of the same job (FSDP with
  accumulation, dp x tp, a 1F1B pipeline, cp 2), and a mean of per-sequence or per-batch
  means is another number on that data. No held-out record is ever in a training batch.

The data and config rules are fast tests below.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtrain.training import recipe
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config, parse_args
from meshtrain.training.data import DataLoader, build_dataloader, build_tokenizer, held_out_range, load_tokens
from meshtrain.training.evaluate import checkpoint_folder, parse_command_line, validation_loader
from tests import oracle, train_oracle
from tests.conftest import ROOT
from tests.forked_ranks import forked_python, forked_ranks
from tests.hf_configs import write_config
from tests.in_process import ENV_KEYS
from tests.test_sft import records, reference_labels, write_jsonl

VAL = ["--validation.split=0.05", "--validation.steps=2"]
# Evaluated after every step (and once more at the end, for the number compared).
BASE = ["--config", "debug_2d", "--training.steps=2", "--training.seq_len=64", *VAL, "--validation.enable=true",
        "--validation.interval=1"]
# name -> layout flags over debug_2d (dp_shard 2 x tp 2); 4 processes each.
LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4", "--parallelism.tp=1"],
    "dp2_tp2_loss_parallel": [],
    "hsdp2x2_accum": ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                      "--training.local_batch_size=2"],
    "cp2_dp2": ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
    "pp2_gpipe_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                      "--parallelism.pp_schedule=GPipe"],
    "pp2_interleaved_tp2": ["--parallelism.pp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2",
                            "--parallelism.pp_schedule=Interleaved1F1B"],
}
# A pipeline schedule switched to its forward-only eval and back between steps re-infers its
# stages' shapes: these twins evaluate only at the end, and must train bitwise alike.
TWINS = {f"{name}_no_val_between": [*LAYOUTS[name], "--validation.enable=false"]
         for name in ("pp2_gpipe_dp2", "pp2_interleaved_tp2")}


def plain_validation_loss(argv: list[str], weights: dict[str, torch.Tensor]) -> float:
    """Plain PyTorch: the model class as an ordinary nn.Module with ``weights``, one
    process, `F.cross_entropy` over every token of each held-out global batch, the mean
    over the batches. From meshtrain only the inputs: the config, the model class, the
    token stream, and the order of windows (DataLoader, one data-parallel rank of one)
    over the held-out tail, which is cut here by hand: the last floor(split * tokens)."""
    cfg, _ = parse_args(argv)
    t = cfg.training
    shape = recipe.build_model(cfg, build_tokenizer(t.tokenizer).vocab_size)
    model = type(shape)(shape.cfg)
    model.load_state_dict(weights, strict=False)  # a tied copy is the same tensor
    assert {n for n, _ in model.named_parameters()} <= set(weights)
    tokens = load_tokens(t.dataset, t.dataset_path, t.tokenizer)
    tail = tokens[len(tokens) - math.floor(len(tokens) * cfg.validation.split):]
    data = DataLoader(tail, seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                      local_batch_size=t.global_batch_size, dp_rank=0, dp_size=1, seed=t.seed)
    losses = []
    with torch.no_grad():
        for k in range(cfg.validation.steps):
            inputs, labels = data.global_batch(k)
            logits = oracle.logits_of(model(inputs))
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item())
    return sum(losses) / len(losses)


# Fine-tuning records with a held-out split (`sft_argv`, below), in the same torchrun job:
# transformers' Qwen2 under FSDP with accumulation, dp x tp with loss_parallel, and a 1F1B
# pipeline; meshtrain's Llama (exported to transformers' LlamaForCausalLM for the
# reference) under cp 2, which transformers' models do not run yet.
SFT_LAYOUTS = {
    "sft_fsdp4_accum": ["--parallelism.dp_shard=4", "--parallelism.tp=1", "--training.local_batch_size=1"],
    "sft_dp2_tp2_loss_parallel": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "sft_pp2_1f1b_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                         "--parallelism.pp_schedule=1F1B"],
    "sft_cp2_dp2_llama": ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("val_layouts")
    runs = {name: [*BASE, *flags, f"--job.output_dir={root}", f"--job.name={name}"]
            for name, flags in {**LAYOUTS, **TWINS}.items()}
    sft_data(root)
    runs.update({name: sft_argv(root, "--training.steps=1", *flags, f"--job.output_dir={root}", f"--job.name={name}",
                                native=name.endswith("_llama"))
                 for name, flags in SFT_LAYOUTS.items()})
    (root / "runs.json").write_text(json.dumps(runs))
    proc = forked_ranks("tests/workers/validation_runs.py", str(root), str(root / "runs.json"), nproc=4, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {name: (runs[name], torch.load(root / f"{name}.pt")) for name in runs}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_validation_loss_equals_plain_pytorch_cross_entropy(layouts, layout):
    """Each layout's number, against a one-process forward with that run's own weights. A
    layout sums in another order than the plain forward; over 2 x 8 x 64 tokens the fp32
    means agree to ~1e-7 relative, so 1e-5 leaves room and still catches a wrong average
    (a factor of 2 for a sum over dp) or other data (~1e-2)."""
    argv, got = layouts[layout]
    want = plain_validation_loss(argv, got["final"])
    assert abs(got["val/loss"] - want) <= 1e-5 * want, (layout, got["val/loss"], want)
    assert got["val/perplexity"] == pytest.approx(math.exp(got["val/loss"]), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SFT_LAYOUTS))
def test_sft_validation_loss_equals_transformers_in_every_layout(layouts, layout, tmp_path):
    """Fine-tuning records, a held-out split of them, 2 validation batches: each layout's
    val/loss, after a training step, equals transformers' own *ForCausalLM holding that
    run's weights, given the held-out sequences with -100 labels -- its mean over their
    response tokens -- to 1e-5; the mean of per-sequence means (micro-batches of one, as
    sft_fsdp4_accum cuts them) is another number on this data.
    Plants (run by hand): training/step.py's token_loss_scale without its all-reduce
    (each rank divides by its own count); Validation back to per-micro-batch means.
    Each fails this test."""
    argv, got = layouts[layout]
    want = transformers_validation_loss(argv, got["final"], sft_rows(), tmp_path)
    assert abs(got["val/loss"] - want["loss"]) <= 1e-5 * want["loss"], (layout, got["val/loss"], want)
    assert got["val/perplexity"] == pytest.approx(math.exp(got["val/loss"]), rel=1e-12)
    assert abs(want["per_sequence"] - want["loss"]) > 10 * 1e-5 * want["loss"], want


@pytest.mark.slow
@pytest.mark.parametrize("twin", list(TWINS))
def test_a_pipeline_evaluated_between_steps_trains_bitwise_alike(layouts, twin):
    """Switched to ``eval`` and back, a torch.distributed.pipelining schedule infers its
    stages' shapes again (a real forward and backward, under its own fork of the RNG):
    that must leave no trace in training. No plant of ours reaches it (evaluation is never
    given the optimizer, and torch's generators are compared in the train.py test below);
    it guards torch's side of the switch."""
    quiet = layouts[twin][1]
    between = layouts[twin.removesuffix("_no_val_between")][1]
    assert between["losses"] == quiet["losses"] and between["grad_norms"] == quiet["grad_norms"]
    assert all(torch.equal(between["final"][k], w) for k, w in quiet["final"].items())
    assert between["val/loss"] == quiet["val/loss"]


# ----------------------------------------------------------------------------- train.py

# FSDP over 2 ranks: each evaluates its share of the held-out batches, averaged over dp (TP
# inside the evaluation, loss_parallel, is the layouts fixture's dp2_tp2_loss_parallel).
TRAIN = ["--config", "debug_2d", "--training.steps=6", "--training.seq_len=64", *VAL,
         "--parallelism.dp_shard=2", "--parallelism.tp=1",
         "--validation.interval=2", "--checkpoint.enable=true", "--checkpoint.interval=2"]


def _train(tmp_path, name, *flags):
    proc = forked_ranks("train.py", *TRAIN, f"--job.output_dir={tmp_path}", f"--job.name={name}", *flags, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def _whole_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint: weights, optimizer state, RNG."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    return flat


def _assert_bitwise(a: dict, b: dict, label: str) -> None:
    assert a.keys() == b.keys(), label
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{label}: differ bitwise: {different[:5]}"


@pytest.mark.slow
def test_validation_changes_no_training_number_resumes_bitwise_and_evaluate_agrees(tmp_path):
    """With [validation] on (every 2 steps and after the last) train.py trains bitwise as
    with it off, resumed or not, and `meshtrain evaluate` on the last checkpoint gives the
    final evaluation's number. Plants caught: `optimizer.step()` inside the evaluation
    (losses and weights move); `torch.rand(1)` inside it without `fork_rng` (the RNG state
    in the checkpoint differs)."""
    on = _train(tmp_path, "on", "--validation.enable=true")
    off = _train(tmp_path, "off", "--validation.enable=false")
    assert "val/loss" in on.stdout and "val/loss" not in off.stdout
    for tag in ("loss", "grad_norm"):
        assert train_oracle.logged(tmp_path / "on", tag) == train_oracle.logged(tmp_path / "off", tag), tag
    last_on = tmp_path / "on" / "checkpoint" / "step-00000006"
    final = _whole_checkpoint(last_on)
    _assert_bitwise(final, _whole_checkpoint(tmp_path / "off" / "checkpoint" / "step-00000006"), "on vs off")
    # Training read only the stream before the held-out tail (what the checkpoint's data state says).
    tokens = len(load_tokens("stdlib"))
    data_state = json.loads((last_on / "meta.json").read_text())["dataloader"]
    assert data_state["num_windows"] == held_out_range(tokens, 0.05, "train")[1] // 65
    val = train_oracle.logged(tmp_path / "on", "val/loss")
    assert len(val) == 3 and len(train_oracle.logged(tmp_path / "on", "val/perplexity")) == 3  # steps 2, 4, 6

    # Interrupted after step 4: the rerun resumes there, evaluates again at 6, ends bitwise alike.
    last_on.rename(tmp_path / "first-step-6")
    _train(tmp_path, "on", "--validation.enable=true")
    _assert_bitwise(_whole_checkpoint(last_on), final, "resumed vs uninterrupted")
    assert train_oracle.logged(tmp_path / "on", "loss") == train_oracle.logged(tmp_path / "off", "loss")
    assert train_oracle.logged(tmp_path / "on", "val/loss") == val

    # The test loop, launched on 2 processes by the command itself: the same layout gives
    # the same number (TensorBoard keeps float32)...
    same = subprocess.run([sys.executable, "-m", "meshtrain.cli", "evaluate", str(last_on.parent), *TRAIN[:-2],
                           f"--out={tmp_path / 'same.json'}", "--nproc-per-node=2", "--standalone"],
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-4000:]
    got = json.loads((tmp_path / "same.json").read_text())
    assert got["step"] == 6 and torch.tensor(got["val/loss"]).item() == val[-1]
    # ... and one process (the whole model, no FSDP or TP) the same within fp32 rounding.
    one = forked_python("-m", "meshtrain.cli", "evaluate", str(last_on), *TRAIN[:-2], "--parallelism.dp_shard=1",
                        "--parallelism.tp=1", f"--out={tmp_path / 'one.json'}", env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert one.returncode == 0, one.stderr[-4000:]
    assert "val/loss" in one.stdout
    assert json.loads((tmp_path / "one.json").read_text())["val/loss"] == pytest.approx(got["val/loss"], rel=1e-5)


# ----------------------------------------------------------------------------- fast

def test_the_held_out_tail_is_disjoint_from_training_and_the_same_in_every_layout():
    t = load_config(None, ["--training.seq_len=64"]).training
    tokens = load_tokens(t.dataset, t.dataset_path, t.tokenizer)
    train_start, cut = held_out_range(len(tokens), 0.05, "train")
    assert (train_start, held_out_range(len(tokens), 0.05, "held_out")) == (0, (cut, len(tokens)))
    assert len(tokens) - cut == math.floor(len(tokens) * 0.05)
    assert held_out_range(len(tokens), 0.0, "train") == (0, len(tokens))
    train, _ = build_dataloader(t, dp_rank=0, dp_size=1, held_out=0.05)
    assert train.num_windows == cut // (t.seq_len + 1)
    # No training window reaches the tail: every window of the training loader lies below the cut.
    seen = torch.cat([train._window_ids(s * t.global_batch_size, t.global_batch_size) for s in range(50)])
    assert int(seen.max()) * (t.seq_len + 1) + t.seq_len + 1 <= cut
    held = validation_loader(load_config(None, ["--training.seq_len=64", *VAL]), dp_rank=0, dp_size=1)
    inputs, labels = held.global_batch(0)
    assert torch.equal(torch.cat([inputs, labels[:, -1:]], 1).flatten()[:65], tokens[cut:][
        held._window_ids(0, 1)[0] * 65:][:65].long())
    # Two dp ranks read the two halves of the same global batch.
    halves = [validation_loader(load_config(None, ["--training.seq_len=64", *VAL]), dp_rank=r, dp_size=2).batch(0)
              for r in range(2)]
    assert torch.equal(torch.cat([h[0][0] for h in halves]), inputs)


def test_prepared_tokens_hold_out_the_same_tail_as_the_text_they_were_made_from(tmp_path):
    """dataset = "tokens" (memory-mapped shards, cut across a shard boundary here) holds out
    exactly the tokens the in-memory text dataset does, as training data or as [validation]
    dataset."""
    from meshtrain.training.prepare_data import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (30 + i))
    prepare([str(corpus)], str(tmp_path / "tokens"), shard_tokens=4000, progress=False)
    text = ["--training.dataset=text", f"--training.dataset_path={corpus}", "--training.seq_len=32",
            "--validation.split=0.1", "--validation.steps=1"]
    prepared = ["--training.dataset=tokens", f"--training.dataset_path={tmp_path / 'tokens'}",
                "--training.seq_len=32", "--validation.split=0.1", "--validation.steps=1"]
    stream = load_tokens("text", str(corpus))
    start, stop = held_out_range(len(stream), 0.1, "held_out")
    for flags in (text, prepared):
        cfg = load_config(None, flags)
        held = validation_loader(cfg, dp_rank=0, dp_size=1)
        train, _ = build_dataloader(cfg.training, dp_rank=0, dp_size=1, held_out=0.1)
        assert len(held.tokens) == stop - start and len(train.tokens) == start, flags
        first = held._window_ids(0, 1)[0] * 33
        assert torch.equal(held.global_batch(0)[0][0], stream[start + first:start + first + 32].long())
    # The same folder as a validation corpus of its own: all of it.
    cfg = load_config(None, ["--validation.dataset=tokens", f"--validation.dataset_path={tmp_path / 'tokens'}",
                             "--training.seq_len=32", "--validation.steps=1"])
    assert len(validation_loader(cfg, dp_rank=0, dp_size=1).tokens) == len(stream)


def test_validation_data_smaller_than_a_batch_is_refused_naming_the_key_and_file(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("too short for one batch " * 10)
    cfg = load_config(None, ["--validation.dataset=text", f"--validation.dataset_path={small}"])
    with pytest.raises(ConfigError, match=r'\[validation\] dataset = "text", dataset_path = ".*small.txt".*'
                                          r"fewer than one global batch"):
        validation_loader(cfg, dp_rank=0, dp_size=1)
    cfg = load_config(None, ["--validation.split=0.0001"])
    with pytest.raises(ConfigError, match=r'\[validation\] split = 0.0001 of \[training\] dataset = "stdlib"'):
        validation_loader(cfg, dp_rank=0, dp_size=1)
    cfg = load_config(None, ["--validation.split=0.01", "--validation.steps=10000"])
    with pytest.raises(ConfigError, match=r"steps = 10000 reads 80000 sequences.*use steps <= \d+ or a larger split"):
        validation_loader(cfg, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("flags,message", [
    (["--validation.enable=true"], "--validation.enable=true, but [validation] has no data: set split"),
    (["--validation.split=0.1", "--validation.dataset=stdlib"], "--validation.split=0.1 holds out part of the"),
    (["--validation.dataset=tokens"], "needs [validation] dataset_path = a folder prepared by `meshtrain prepare-data`"),
    (["--validation.dataset=sft"], "needs [validation] dataset_path = a .jsonl/.parquet file, a folder of them"),
    (["--validation.dataset_path=x"], 'is read only with [validation] dataset = "text", "tokens" or "sft"'),
    (["--validation.split=1"], "--validation.split=1.0 is out of range; accepted: >= 0 and < 1"),
    (["--validation.interval=0"], "--validation.interval=0 is out of range; accepted: >= 1"),
    (["--validation.every=3"], "unknown key 'every' in [validation]. Accepted keys of [validation]: enable"),
])
def test_bad_validation_settings_are_refused_with_the_key(flags, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, flags)
    assert message in str(err.value)


def test_a_held_out_split_round_trips_through_toml(tmp_path):
    from meshtrain.training.config_loader import config_to_toml

    cfg = load_config(None, ["--validation.enable=true", "--validation.split=0.05", "--validation.interval=7"])
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg and cfg.validation.split == 0.05


def test_validation_settings_in_a_file_are_named_with_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[validation]\nenable = true\n")
    with pytest.raises(ConfigError, match=r"run.toml: \[validation\] enable = true, but \[validation\] has no data"):
        load_config(path)


def test_a_missing_validation_corpus_is_refused_before_any_process_group(tmp_path):
    cfg = load_config(None, ["--validation.dataset=text", f"--validation.dataset_path={tmp_path / 'nowhere'}"])
    model = recipe.build_model(cfg, build_tokenizer("byte").vocab_size)
    with pytest.raises(ConfigError, match=r'\[validation\] dataset = "text" needs dataset_path.*does not exist'):
        recipe.plan_layout(cfg, model, world_size=4)


def test_evaluate_refuses_a_checkpoint_folder_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint folder at .*nowhere.*it does not exist"):
        parse_command_line([str(tmp_path / "nowhere"), "--config", "debug_2d", *VAL])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        checkpoint_folder(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="meshtrain evaluate, but \\[validation\\] has no data"):
        parse_command_line([str(tmp_path), "--config", "debug_2d"])


def test_evaluate_command_help_and_one_line_errors(tmp_path, capsys):
    from meshtrain import cli

    assert cli.main(["evaluate", "--help"]) == 0
    assert "usage: meshtrain evaluate CHECKPOINT --config NAME" in capsys.readouterr().out
    assert cli.main(["evaluate", str(tmp_path / "nowhere"), "--config", "debug_2d", *VAL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain: error: meshtrain evaluate: no checkpoint folder at") and "Traceback" not in err


# ----------------------------------------------------------------------------- sft

SFT_SPLIT = 0.2


def sft_rows() -> list[dict]:
    return records(200, seed=11)


def sft_data(root: Path) -> list[dict]:
    """In ROOT: a tiny Qwen2 config.json (qwen2/) and 200 prompt/response records
    (records.jsonl) of varied lengths; returns the records. The Qwen2 starts with large
    weights: peaked logits, so token losses differ widely and a mean of means shows."""
    config = write_config(root / "qwen2", "qwen2") / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "initializer_range": 0.5}))
    rows = sft_rows()
    write_jsonl(root / "records.jsonl", rows)
    return rows


def sft_argv(root: Path, *flags: str, native: bool = False) -> list[str]:
    """Fine-tuning on ROOT's records with SFT_SPLIT of them held out and 2 validation
    batches: transformers' Qwen2 from ROOT's config.json, or (``native``) meshtrain's
    debug Llama, which context parallelism needs."""
    model = ["--config", "debug_2d"] if native else ["--config", "hf_debug", f"--model.hf_config={root / 'qwen2'}"]
    return [*model, *sft_flags(root), *flags]


def sft_flags(root: Path) -> list[str]:
    """`sft_argv`'s data and validation: the model is the default one unless given."""
    return ["--training.dataset=sft", f"--training.dataset_path={root / 'records.jsonl'}",
            "--training.document_masking=false", "--training.seq_len=96", "--training.global_batch_size=8",
            f"--validation.split={SFT_SPLIT}", "--validation.steps=2"]


def transformers_model(cfg, weights: dict[str, torch.Tensor], folder: Path):
    """transformers' own *ForCausalLM (not a meshtrain class) holding ``weights``: for
    `[model] name = "hf"` the class of its config.json, loaded by parameter name; for
    meshtrain's Llama, LlamaForCausalLM.from_pretrained of the weights written as a
    Hugging Face folder (FOLDER)."""
    import transformers

    shape = recipe.build_model(cfg, build_tokenizer(cfg.training.tokenizer).vocab_size)
    if cfg.model.name == "hf":
        from meshtrain.models.hf.model import causal_lm_class

        cls = causal_lm_class(shape.cfg.hf)
        plain = cls(cls.config_class.from_dict(shape.cfg.hf))
        assert {n for n, _ in plain.named_parameters()} <= set(weights)
        plain.load_state_dict(weights, strict=False)  # a tied copy is the same tensor
    else:
        from meshtrain.models.llama.hf import save_hf

        save_hf(weights.items(), shape.cfg, folder)
        plain = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert type(plain).__module__.startswith("transformers.")
    return plain.eval()


def transformers_validation_loss(argv: list[str], weights: dict[str, torch.Tensor], rows: list[dict],
                                 folder: Path) -> dict[str, float]:
    """transformers' loss over every held-out sequence of the [validation] steps batches at
    once, labels -100 but on the responses (found from the records' bytes, tests/test_sft.py):
    "loss", the mean over the counted tokens. Beside it, what a mean of means would say:
    "per_sequence" (the mean of each sequence's own mean: a micro-batch of one sequence)
    and "per_batch" (the mean of each global batch's mean). From meshtrain only the
    packed sequences of the held-out records, read as one data-parallel rank."""
    cfg, _ = parse_args(argv)
    plain = transformers_model(cfg, weights, folder)
    held = validation_loader(cfg, dp_rank=0, dp_size=1)
    bufs = np.concatenate([held.global_sequences(k)[0] for k in range(cfg.validation.steps)])
    inputs = torch.from_numpy(bufs)
    labels = torch.from_numpy(np.stack([reference_labels(b, rows) for b in bufs]))
    G = cfg.training.global_batch_size
    with torch.no_grad():
        loss = lambda a, b: plain(input_ids=inputs[a:b], labels=labels[a:b]).loss.item()
        return {"loss": loss(0, len(bufs)),
                "per_sequence": sum(loss(i, i + 1) for i in range(len(bufs))) / len(bufs),
                "per_batch": sum(loss(k, k + G) for k in range(0, len(bufs), G)) / (len(bufs) // G)}


@contextlib.contextmanager
def world_of_one():
    """A gloo group of one rank in this process (parallel/mesh.py starts it), taken down
    afterwards with the launcher's variables it set."""
    import torch.distributed as dist

    saved = {k: os.environ.pop(k) for k in ENV_KEYS if k in os.environ}
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in ENV_KEYS:
            os.environ.pop(key, None)
        os.environ.update(saved)


def test_sft_validation_loss_is_transformers_mean_over_the_held_out_response_tokens(tmp_path):
    """One process, 4 micro-batches of 2 sequences per batch, 2 batches: val/loss equals
    one forward of transformers' Qwen2ForCausalLM over all 16 held-out sequences with -100
    labels (its mean over their response tokens), and val/perplexity is its exp. The mean
    of per-sequence means and the mean of per-batch means are other numbers on this data,
    so the check can tell them apart.
    Plant (run by hand): Validation back to each micro-batch's mean divided by their count
    and the batches' means averaged (what it did for pretraining) -- this test fails."""
    from tests.workers.recipe_runs import build_run, full_weights
    from meshtrain.training.evaluate import Validation

    rows = sft_data(tmp_path)
    argv = sft_argv(tmp_path, "--parallelism.dp_shard=1", "--parallelism.tp=1", "--training.local_batch_size=2")
    with world_of_one():
        cfg, model, layout, mesh, parts, *_ = build_run(argv)
        got = Validation(cfg, layout, parts, torch.device("cpu")).run()
        weights = full_weights(parts.modules, None, {a for names in model.tied_weights() for a in names[1:]})
    want = transformers_validation_loss(argv, weights, rows, tmp_path / "hf")
    assert abs(got["val/loss"] - want["loss"]) <= 1e-5 * want["loss"], (got, want)
    assert got["val/perplexity"] == pytest.approx(math.exp(got["val/loss"]), rel=1e-12)
    for mean_of_means in ("per_sequence", "per_batch"):
        assert abs(want[mean_of_means] - want["loss"]) > 10 * 1e-5 * want["loss"], (mean_of_means, want)


def _record_ids(buf: np.ndarray, rows: list[dict]) -> list[int]:
    """The records packed in a sequence, by the tag each prompt starts with ("#17: ..."),
    each checked whole (tests/test_sft.py `reference_labels`)."""
    reference_labels(buf, rows)
    return [int(t.split(b":")[0]) for t in bytes(buf[buf < 256].tolist()).split(b"#")[1:]]


def test_a_held_out_sft_record_is_never_in_a_training_batch(tmp_path):
    """[validation] split = 0.2 of 200 records: the held-out loader packs exactly 40 whole
    records, every training batch of a whole epoch and more packs only the other 160, and
    all of them -- for the .jsonl and for the folder `meshtrain prepare-data --kind sft`
    made of it, at any seed, seq_len or dp size. They are spread over the file, not its
    tail. Plant (run by hand): training/sft_files.py `held_out_records` giving the train
    part every record -- this test fails."""
    from meshtrain.training.prepare_data import main as prepare

    rows = sft_data(tmp_path)
    assert prepare([str(tmp_path / "records.jsonl"), "--kind", "sft", "--out", str(tmp_path / "prepared"),
                    "--workers", "2"]) == 0
    seen_held = []
    for path, more in ((tmp_path / "records.jsonl", []), (tmp_path / "prepared", []),
                       (tmp_path / "records.jsonl", ["--training.seed=7", "--training.seq_len=128"])):
        cfg = load_config(None, [*sft_flags(tmp_path), *more, f"--training.dataset_path={path}"])
        t = cfg.training
        train, _ = build_dataloader(t, dp_rank=0, dp_size=1, held_out=SFT_SPLIT)
        held = validation_loader(cfg, dp_rank=0, dp_size=1)
        held_ids = {i for w in range(held.num_windows) for i in _record_ids(held.sequences(torch.tensor([w]))[0][0], rows)}
        trained = set()
        for step in range(train.num_windows // t.global_batch_size + 2):  # past one epoch: every sequence
            trained |= {i for buf in train.global_sequences(step)[0] for i in _record_ids(buf, rows)}
        assert len(held_ids) == math.floor(200 * SFT_SPLIT) and not held_ids & trained, path
        assert held_ids | trained == set(range(200))
        halves = [validation_loader(cfg, dp_rank=r, dp_size=2).batch(0)[0][0] for r in range(2)]
        assert torch.equal(torch.cat(halves), held.global_batch(0)[0])  # two dp ranks: the same batch
        seen_held.append(held_ids)
    assert seen_held[0] == seen_held[1] == seen_held[2]
    assert min(seen_held[0]) < 50 and max(seen_held[0]) > 150, "spread over the records, not a tail"


def test_sft_validation_data_of_its_own_and_too_little_of_it(tmp_path):
    """[validation] dataset = "sft" reads every record of its own dataset_path (training
    then holds nothing out); too few records for [validation] steps batches, or a split
    holding out too few, stops at start-up naming where the data came from."""
    rows = sft_data(tmp_path)
    write_jsonl(tmp_path / "val.jsonl", records(60, seed=12))
    own = ["--validation.split=0", "--validation.dataset=sft", f"--validation.dataset_path={tmp_path / 'val.jsonl'}"]
    cfg = load_config(None, [*sft_flags(tmp_path), *own, "--validation.steps=1"])
    held = validation_loader(cfg, dp_rank=0, dp_size=1)
    assert held.ids is None and len(held.lengths) == 60
    train, _ = build_dataloader(cfg.training, dp_rank=0, dp_size=1, held_out=cfg.validation.split)
    assert len(train.lengths) == len(rows)
    cfg = load_config(None, [*sft_flags(tmp_path), *own, "--validation.steps=20"])
    with pytest.raises(ConfigError, match=r'\[validation\] dataset = "sft", dataset_path = ".*val.jsonl": '
                                          r"\[validation\] steps = 20 reads 160 sequences.*use steps <= \d$"):
        validation_loader(cfg, dp_rank=0, dp_size=1)
    cfg = load_config(None, [*sft_flags(tmp_path), "--validation.split=0.01"])
    with pytest.raises(ConfigError, match=r'\[validation\] split = 0.01 of \[training\] dataset = "sft" \(".*records'
                                          r'.jsonl"\): corpus too small: 2 records held out for validation of .* pack '
                                          r"into 2 sequences"):
        validation_loader(cfg, dp_rank=0, dp_size=1)


def test_sft_validation_with_no_response_token_left_is_refused(tmp_path):
    """Records whose prompts fill the whole sequence, so truncation cuts every response:
    no token to score, which would read as a loss of 0. Refused, naming the data and seq_len."""
    long_prompts = [{"prompt": f"#{i}: " + "x" * 120, "response": " done."} for i in range(40)]
    write_jsonl(tmp_path / "val.jsonl", long_prompts)
    sft_data(tmp_path)
    own = ["--validation.split=0", "--validation.dataset=sft", f"--validation.dataset_path={tmp_path / 'val.jsonl'}",
           "--validation.steps=1"]
    cfg = load_config(None, [*sft_flags(tmp_path), *own])
    with pytest.raises(ConfigError, match=r'dataset_path = ".*val.jsonl": the 1 validation batches hold no response '
                                          r"token to score .*seq_len \+ 1 = 97"):
        validation_loader(cfg, dp_rank=0, dp_size=1)
