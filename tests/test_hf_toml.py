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

import pytest
import torch

from tests import oracle, train_oracle
from tests.conftest import torchrun

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=320, max_position_embeddings=128, pad_token_id=None,
              bos_token_id=0, eos_token_id=0, initializer_range=0.02)
ARCHS = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], tie_word_embeddings=False),
    # GPT-2: Conv1D projections, no TP or pipeline plan, learned positions, tied embeddings.
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=64, n_head=4,
                 vocab_size=320, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}
LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4", "--parallelism.tp=1"],
    "dp2_tp2": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "pp2_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
}
RUNS = [(arch, layout) for arch in ARCHS for layout in LAYOUTS if arch != "gpt2" or layout == "fsdp4"]
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
