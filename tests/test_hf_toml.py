"""`[model] name = "hf"`: transformers' own models, built from tiny config.json files
(tests/hf_configs.py), trained through the recipe train.py uses under FSDP x 4, dp 2 x tp 2
and pp 2 x dp 2, and judged against plain PyTorch running transformers' unmodified class
in one process (tests/train_oracle.py, tests/oracle.py) with clipping that binds. One
job of four processes trains every architecture and layout in turn. Then weights in and out:
safetensors loaded sharded, a checkpoint exported for transformers.

The architectures, each chosen for what it exercises: Qwen2 (q/k/v biases, tied
embeddings, also tied across pipeline stages), Phi3 (fused qkv and gate_up projections:
"colwise_gather_output" / "rowwise_split_input"), OLMo2 (norms over the whole q and k
projections, after attention and MLP rather than before), Qwen3 (per-head q/k norms:
"replicated_with_grad_allreduce"), GPT-NeoX (a plan that splits the embedding itself:
"embedding_rowwise"; also split by columns and left whole through [model] hf_tp_plan),
Granite (embedding, residual, attention and logit multipliers), Llama, GPT-2 (FSDP
only: no TP plan; its refusals are in tests/test_hf_refusals.py), and Qwen3-MoE under
expert parallelism (FSDP x EP, FSDP x EP x TP, PP x FSDP x EP), started from a folder transformers'
save_pretrained wrote (`initial_load_hf`: one tensor per expert, fused as it loads) and
judged against the unmodified class from_pretrained loads, in gradients too."""

from __future__ import annotations


import pytest
import torch

from tests import oracle, train_oracle
from tests.conftest import recipe_runs
from tests.forked_ranks import forked_python, forked_ranks
from tests.hf_configs import ARCHS, write_config

LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4", "--parallelism.tp=1"],
    "dp2_tp2": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "pp2_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
}
# GPT-NeoX's own plan, but its embedding split by columns, or left whole, instead of by rows.
NEOX_BLOCKS = ("layers.*.attention.query_key_value=colwise,layers.*.attention.dense=rowwise,"
               "layers.*.mlp.dense_h_to_4h=colwise,layers.*.mlp.dense_4h_to_h=rowwise")
LAYOUTS.update({f"dp2_tp2_embed_{word}": [*LAYOUTS["dp2_tp2"], f"--model.hf_tp_plan=embed_in={word},{NEOX_BLOCKS}"]
                for word in ("embedding_colwise", "replicate")})
# Expert parallelism over 2 of the dp_shard ranks: each holds 4 of the 8 experts.
LAYOUTS.update({f"{name}_ep2": [*LAYOUTS[name], "--parallelism.ep=2"] for name in ("fsdp4", "dp2_tp2", "pp2_dp2")})
# Each architecture's layouts, if not the first three: GPT-2 has no TP plan, Granite
# rescales its embeddings in forward (no pipeline), Qwen3 and Llama add only to TP.
ONLY = {"gpt2": ["fsdp4"], "qwen3": ["dp2_tp2"], "granite": ["dp2_tp2"], "llama": ["dp2_tp2"],
        "gpt_neox": [name for name in LAYOUTS if "ep2" not in name], "qwen3_moe": ["fsdp4_ep2", "dp2_tp2_ep2", "pp2_dp2_ep2"]}
# Architectures that start from weights transformers saved (`initial_load_hf`), not meshtrain's init.
FROM_SAVED = {"qwen3_moe"}
RUNS = [(arch, layout) for arch in ARCHS for layout in ONLY.get(arch, ["fsdp4", "dp2_tp2", "pp2_dp2"])]
# The debug config's stdlib bytes, short runs; clipping at 0.1 binds every step.
TRAIN = ["--training.steps=4", "--training.seq_len=32", "--training.global_batch_size=8",
         "--training.max_norm=0.1", "--optimizer.lr=3e-3"]


def argv(folder, arch: str, layout: str, out) -> list[str]:
    load = [f"--checkpoint.initial_load_hf={folder / arch}"] if arch in FROM_SAVED else []
    return ["--config", "hf_debug", f"--model.hf_config={folder / arch}", *load, *TRAIN, *LAYOUTS[layout],
            f"--job.output_dir={out}", f"--job.name={arch}_{layout}"]


def save_pretrained(folder, seed: int = 7) -> None:
    """transformers' own model of FOLDER/config.json, initialized by transformers, saved
    there as its save_pretrained writes it (fused experts: one tensor per expert)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_toml")
    for arch in ARCHS:
        write_config(root / arch, arch)
    for arch in FROM_SAVED:
        save_pretrained(root / arch)
    runs = {f"{a}_{l}": argv(root, a, l, root / "out") for a, l in RUNS}
    return root, recipe_runs(root, runs, nproc=4, timeout=900)


@pytest.fixture(scope="module")
def oracles(setup):
    root, _ = setup  # the reference of a run does not depend on its layout: one per architecture
    return {arch: train_oracle.oracle_for(*argv(root, arch, "fsdp4", root / "ref"), with_unclipped=True)
            for arch in dict.fromkeys(arch for arch, _ in RUNS)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_clipping_binds_for_each_architecture(oracles, arch):
    oracle.assert_clipping_binds(oracles[arch], arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", RUNS)
def test_hf_model_from_toml_trains_like_plain_transformers(setup, oracles, arch, layout):
    _, results = setup
    got = results[f"{arch}_{layout}"]
    label = f"{arch} {layout}"
    oracle.assert_matches(got["losses"], got["grad_norms"], got["final"], oracles[arch], label)
    assert got["losses"][-1] < got["losses"][0] - 0.1, f"{label}: did not learn {got['losses']}"
    if "tp2" in layout:  # TP really split the blocks and the ends as the plan says (one matching nothing would not)
        split = got["tp_sharded"]
        assert all(split.get(name) == "S(0)" for name in column_split(arch)), split
        embedding, word = EMBEDDING.get(arch, "model.embed_tokens.weight"), layout.partition("_embed_")[2]
        assert split.get(embedding) == {"embedding_colwise": "S(1)", "replicate": None}.get(word, "S(0)"), split
        tied = ARCHS[arch].get("tie_word_embeddings")  # tied: listed once, as the embedding
        assert split.get("lm_head.weight") == (None if tied else "S(0)"), split
    if "ep2" in layout:  # each expert weight split by expert over ep, nothing else
        experts = {f"model.layers.{i}.mlp.experts.{w}": "S(0)" for i in (1, 2) for w in ("gate_up_proj", "down_proj")}
        if "pp2" in layout:  # rank 0's stage: blocks 0 and 1
            experts = {name: p for name, p in experts.items() if ".layers.1." in name}
        assert got["ep_sharded"] == experts, got["ep_sharded"]
        over_tp = {name: p for name, p in got["tp_sharded"].items() if ".experts." in name}
        assert set(over_tp.values()) <= {"R"}, over_tp  # whole on each tp rank


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [(a, l) for a, l in RUNS if "ep2" in l])
def test_hf_moe_under_expert_parallelism_has_transformers_gradients(setup, oracles, arch, layout):
    """The last step's gradient of every weight (clipped) against the unmodified class's,
    within K of the reference's own rounding scale for that tensor (fp32 vs fp64)."""
    _, results = setup
    got, ref = results[f"{arch}_{layout}"]["grads"], oracles[arch]
    assert set(got) == set(ref.fp32.grads), set(got) ^ set(ref.fp32.grads)
    for name, want in ref.fp32.grads.items():
        runs = (ref.fp32, ref.fp32_split, ref.fp64)
        noise = max((a.grads[name] - b.grads[name]).abs().max().item() for a in runs for b in runs)
        scale = want.abs().max().item()
        assert (got[name] - want).abs().max().item() <= oracle.K * (noise + 4 * oracle.ULP * scale), (
            f"{arch} {layout}: {name} gradient off by {(got[name] - want).abs().max().item():.3g} "
            f"(rounding scale {noise:.3g})")


EMBEDDING = {"gpt_neox": "gpt_neox.embed_in.weight"}


def column_split(arch: str) -> list[str]:
    """The attention's input projection of each block, which TP splits by output rows."""
    if arch == "gpt_neox":
        return [f"gpt_neox.layers.{i}.attention.query_key_value.weight" for i in range(2)]
    return [f"model.layers.{i}.self_attn.{'qkv_proj' if arch == 'phi3' else 'q_proj'}.weight" for i in range(2)]


# ---- weights in and out: safetensors loaded sharded, checkpoints exported for transformers ----

@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory):
    """One dp 2 x tp 2 train.py job, 3 steps, starting from a folder transformers wrote and
    saving checkpoints: (its output folder, the HF folder, the transformers model, its argv)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qwen2_run")
    folder = write_config(root / "qwen2", "qwen2")
    torch.manual_seed(7)
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    plain.save_pretrained(folder)  # config.json + model.safetensors
    args = ["--config", "hf_debug", f"--model.hf_config={folder}", f"--checkpoint.initial_load_hf={folder}",
            "--training.steps=3", "--training.seq_len=32", "--checkpoint.enable=true", f"--job.output_dir={root}",
            "--job.name=run"]
    proc = forked_ranks("train.py", *args, nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, folder, plain, args


@pytest.mark.slow
def test_initial_hf_weights_load_sharded_and_give_transformers_loss(qwen2_run):
    """dp 2 x tp 2 starts from a folder transformers wrote: the first step's loss (before
    any update) is the one transformers computes on the same batch."""
    import torch.nn.functional as F

    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.data import build_dataloader

    root, _, plain, args = qwen2_run
    got = train_oracle.logged(root / "run", "loss")[0]
    cfg, _ = parse_args(args)
    data, _ = build_dataloader(cfg.training, dp_rank=0, dp_size=1)
    with torch.no_grad():
        losses = [F.cross_entropy(plain(x).logits.flatten(0, 1), y.flatten()) for x, y in data.batch(0)]
    want = float(sum(losses) / len(losses))
    assert abs(got - want) < 1e-5 * want, (got, want)


@pytest.mark.slow
def test_export_reloads_in_transformers_with_the_trained_models_logits(qwen2_run):
    """A dp 2 x tp 2 run's checkpoint, exported with --format hf, loads with
    AutoModelForCausalLM.from_pretrained (tied embeddings tied) and gives the logits of
    meshtrain's model holding the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    from meshtrain.models.hf.model import build_hf
    from meshtrain.training.checkpoint import complete_checkpoints
    from meshtrain.training.export import model_tensors

    root, folder, _, _ = qwen2_run
    _, step = max(complete_checkpoints(root / "run" / "checkpoint"))
    exported = forked_python("-m", "meshtrain.training.export", str(step), str(root / "hf"), "--format", "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    loaded = AutoModelForCausalLM.from_pretrained(root / "hf")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ours = build_hf(str(folder))
    ours.init_weights(device="cpu")
    weights = dict(model_tensors(step))
    ours.load_state_dict({n: weights[n] for n in ours.state_dict()})
    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, ours(tokens), atol=1e-6, rtol=0)
    assert not torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))  # trained
