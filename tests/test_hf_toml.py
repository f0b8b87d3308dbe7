"""`[model] name = "hf"`: transformers' own models, built from a config.json written here,
trained through the recipe train.py uses under FSDP x 4, dp 2 x tp 2 and pp 2 x dp 2, and
judged against plain PyTorch running transformers' unmodified class in one process
(tests/train_oracle.py, tests/oracle.py) with clipping that binds.

Three architectures besides Llama and GPT-2, each shipping a TP plan, chosen for what
they exercise: Qwen2 (q/k/v biases, tied embeddings, also tied across pipeline stages),
Phi3 (fused qkv and gate_up projections: transformers' "colwise_gather_output" /
"rowwise_split_input" styles) and OLMo2 (norms over the whole q and k projections, after
attention and MLP rather than before)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests import oracle, train_oracle
from tests.conftest import ROOT, dry_run_refusal, torchrun

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=320, max_position_embeddings=128, pad_token_id=None,
              bos_token_id=0, eos_token_id=0, initializer_range=0.02)
ARCHS = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], tie_word_embeddings=False),
    # Qwen3: per-head q/k norms, whole on every TP rank ("replicated_with_grad_allreduce").
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16, tie_word_embeddings=False),
    # GPT-2: Conv1D projections, no TP or pipeline plan, learned positions, tied embeddings.
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=64, n_head=4,
                 vocab_size=320, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 bos_token_id=0, eos_token_id=0),
}
LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4", "--parallelism.tp=1"],
    "dp2_tp2": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "pp2_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
}
ONLY = {"gpt2": "fsdp4", "qwen3": "dp2_tp2"}
RUNS = [(arch, layout) for arch in ARCHS for layout in LAYOUTS if ONLY.get(arch, layout) == layout]
# The debug config's stdlib bytes, short runs; clipping at 0.1 binds every step.
TRAIN = ["--training.steps=6", "--training.seq_len=32", "--training.global_batch_size=8",
         "--training.max_norm=0.1", "--optimizer.lr=3e-3"]


def write_config(folder, arch: str):
    folder.mkdir(parents=True, exist_ok=True)
    config = ARCHS[arch] if arch == "gpt2" else {**COMMON, **ARCHS[arch]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def argv(folder, arch: str, layout: str, out) -> list[str]:
    return ["--config", "hf_debug", f"--model.hf_config={folder / arch}", *TRAIN, *LAYOUTS[layout],
            f"--job.output_dir={out}", f"--job.name={arch}_{layout}"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_toml")
    for arch in ARCHS:
        write_config(root / arch, arch)
    runs = {f"{a}_{l}": argv(root, a, l, root / "out") for a, l in RUNS}
    (root / "runs.json").write_text(json.dumps(runs))
    proc = torchrun("tests/workers/recipe_runs.py", str(root), str(root / "runs.json"), nproc=4, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root, {name: torch.load(root / f"{name}.pt") for name in runs}


@pytest.fixture(scope="module")
def oracles(setup):
    root, _ = setup
    return {arch: train_oracle.oracle_for(*argv(root, arch, "fsdp4", root / "ref"), with_unclipped=True)
            for arch in ARCHS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_clipping_binds_for_each_architecture(oracles, arch):
    oracle.assert_clipping_binds(oracles[arch], arch)


@pytest.mark.parametrize("arch,layout", RUNS)
def test_hf_model_from_toml_trains_like_plain_transformers(setup, oracles, arch, layout):
    _, results = setup
    got = results[f"{arch}_{layout}"]
    label = f"{arch} {layout}"
    oracle.assert_matches(got["losses"], got["grad_norms"], got["final"], oracles[arch], label)
    assert got["losses"][-1] < got["losses"][0] - 0.1, f"{label}: did not learn {got['losses']}"
    if layout == "dp2_tp2":  # TP really split the blocks and both ends (a plan matching nothing would not)
        q = "qkv_proj" if arch == "phi3" else "q_proj"
        want = {f"model.layers.{i}.self_attn.{q}.weight" for i in range(2)} | {"model.embed_tokens.weight"}
        assert want <= set(got["tp_sharded"]), got["tp_sharded"]
        assert ("lm_head.weight" in got["tp_sharded"]) == (arch != "qwen2")  # tied: listed once, as the embedding


# ---- one process: what is refused, before any process group, and why ----

def refusal(tmp_path, *args: str) -> str:
    """The one-line error of a dry run of hf_debug at 4 ranks with ``args``."""
    return dry_run_refusal("--config", "hf_debug", "--world-size", "4", f"--job.output_dir={tmp_path}", *args)


def extra_config(tmp_path, name: str, **config) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_conv1d_model_without_a_tp_plan_refuses_tp_and_says_fsdp_trains_it(tmp_path):
    gpt2 = str(write_config(tmp_path / "gpt2", "gpt2"))
    message = refusal(tmp_path, f"--model.hf_config={gpt2}")
    assert "tp = 2" in message and "GPT2LMHeadModel has no tensor-parallel plan" in message
    assert "use tp = 1 (FSDP alone trains it)" in message
    # A plan given in the TOML that splits a Conv1D (weights stored [in, out]) is refused by name.
    message = refusal(tmp_path, f"--model.hf_config={gpt2}", "--model.hf_tp_plan=h.*.mlp.c_fc=colwise")
    assert "transformer.h.0.mlp.c_fc" in message and "transformers.pytorch_utils.Conv1D" in message


def test_tp_plan_styles_that_cannot_be_translated_are_named(tmp_path):
    qwen3 = str(write_config(tmp_path / "qwen3", "qwen3"))
    message = refusal(tmp_path, f"--model.hf_config={qwen3}", "--model.hf_tp_plan=layers.*.mlp.up_proj=sharded")
    assert "'layers.*.mlp.up_proj=sharded' is not \"module.pattern=style\"" in message


def test_a_tp_plan_from_the_toml_replaces_the_architectures(tmp_path):
    qwen3 = str(write_config(tmp_path / "qwen3", "qwen3"))
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args

    cfg, _ = parse_args(["--config", "hf_debug", f"--model.hf_config={qwen3}",
                         "--model.hf_tp_plan=layers.*.mlp.up_proj=colwise,layers.*.mlp.down_proj=rowwise"])
    model = recipe.build_model(cfg, 258)
    plan = model.tp_plan(loss_parallel=False)
    assert sorted(k for k in plan if "layers" in k) == ["model.layers.*.mlp.down_proj", "model.layers.*.mlp.up_proj"]


def test_an_architecture_that_rescales_its_embeddings_refuses_a_pipeline(tmp_path):
    granite = extra_config(tmp_path, "granite", **COMMON, model_type="granite", embedding_multiplier=12.0)
    message = refusal(tmp_path, f"--model.hf_config={granite}", "--parallelism.tp=1", "--parallelism.pp=2")
    assert "GraniteForCausalLM transforms its embeddings in forward before the first block" in message
    assert "use pp = 1" in message


def test_block_classes_that_the_model_lacks_are_refused_naming_the_ones_it_has(tmp_path):
    message = refusal(tmp_path, "--model.hf_block_classes=LlamaDecoderLayer")
    assert "hf_config" in message and "['LlamaDecoderLayer']" in message and "Qwen2DecoderLayer" in message
    message = refusal(tmp_path, "--model.hf_block_classes=Qwen2MLP")
    assert "Qwen2MLP is not the repeated layer of Qwen2Model" in message


def test_a_model_that_is_not_a_causal_lm_or_that_transformers_refuses_is_refused(tmp_path):
    t5 = extra_config(tmp_path, "t5", model_type="t5", d_model=64)
    message = refusal(tmp_path, f"--model.hf_config={t5}")
    assert f'[model] hf_config = "{t5}"' in message and 'model_type "t5" is not a causal language model' in message
    odd = extra_config(tmp_path, "odd", **{**COMMON, "num_attention_heads": 12}, model_type="bert")
    message = refusal(tmp_path, f"--model.hf_config={odd}")
    assert "transformers cannot build BertLMHeadModel from it" in message and "(12)" in message


def test_config_problems_name_the_key_and_the_file(tmp_path):
    assert '"nowhere" is neither a config.json nor a folder holding one' in refusal(
        tmp_path, "--model.hf_config=nowhere")
    assert "name = \"hf\" needs hf_config = a Hugging Face config.json" in refusal(tmp_path, "--model.hf_config=")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert f"{bad} is not JSON" in refusal(tmp_path, f"--model.hf_config={bad}")
    assert 'is for [model] name = "hf"' in refusal(tmp_path, "--model.name=llama")
    assert "leave vocab_size at 0" in refusal(tmp_path, "--model.vocab_size=384")


def test_missing_transformers_is_refused_naming_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert 'pip install "meshtrain[hf]"' in refusal(tmp_path)


# ---- weights in and out: safetensors loaded sharded, checkpoints exported for transformers ----

def test_initial_hf_weights_load_sharded_and_give_transformers_loss(tmp_path):
    """dp 2 x tp 2 starts from a folder transformers wrote: the first step's loss is the one
    transformers computes on the same batch."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.data import build_dataloader

    folder = write_config(tmp_path / "qwen2", "qwen2")
    torch.manual_seed(7)
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    plain.save_pretrained(folder)  # config.json + model.safetensors
    args = ["--config", "hf_debug", f"--model.hf_config={folder}", f"--checkpoint.initial_load_hf={folder}",
            "--training.steps=1", "--training.seq_len=32", f"--job.output_dir={tmp_path}", "--job.name=load"]
    proc = torchrun("train.py", *args, nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = train_oracle.logged(tmp_path / "load", "loss")[0]
    cfg, _ = parse_args(args)
    data, _ = build_dataloader(cfg.training, dp_rank=0, dp_size=1)
    with torch.no_grad():
        losses = [F.cross_entropy(plain(x).logits.flatten(0, 1), y.flatten()) for x, y in data.batch(0)]
    want = float(sum(losses) / len(losses))
    assert abs(got - want) < 1e-5 * want, (got, want)


def test_export_reloads_in_transformers_with_the_trained_models_logits(tmp_path):
    """A dp 2 x tp 2 run's checkpoint, exported with --format hf, loads with
    AutoModelForCausalLM.from_pretrained (tied embeddings tied) and gives the logits of
    meshtrain's model holding the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    from meshtrain.models.hf.model import build_hf
    from meshtrain.training.checkpoint import complete_checkpoints
    from meshtrain.training.export import model_tensors

    folder = write_config(tmp_path / "qwen2", "qwen2")
    proc = torchrun("train.py", "--config", "hf_debug", f"--model.hf_config={folder}", "--training.steps=3",
                    "--training.seq_len=32", "--checkpoint.enable=true", f"--job.output_dir={tmp_path}",
                    "--job.name=run", nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, step = max(complete_checkpoints(tmp_path / "run" / "checkpoint"))
    exported = subprocess.run([sys.executable, "-m", "meshtrain.training.export", str(step), str(tmp_path / "hf"), "--format",
                               "hf"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ours = build_hf(str(folder))
    ours.init_weights(device="cpu")
    weights = dict(model_tensors(step))
    ours.load_state_dict({n: weights[n] for n in ours.state_dict()})
    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, ours(tokens), atol=1e-6, rtol=0)
    assert not torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))  # trained
