"""`[model]` takes a native family's dimensions directly (dim, n_layers, n_heads, n_kv_heads,
ffn_hidden, vocab_size): the model built, the planner's count of it and `meshtrain plan`'s
flags agree with hand arithmetic, and what a family cannot take is refused by key.
One process, no GPU."""

import pytest

from meshtrain.physics.gpus import get_gpu
from meshtrain.planning.estimate import estimate, estimate_config
from meshtrain.planning.plan import resolve_model, run as plan_run
from meshtrain.planning.report import to_toml
from meshtrain.planning.search import candidates
from meshtrain.planning.verify import trace
from meshtrain.planning.shape import Job
from meshtrain.training import recipe
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config
from tests.conftest import ROOT

H100 = get_gpu("h100-80gb")
# Llama 3.2 3B's published shape (its config.json), untied here.
SHAPE = dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192, vocab_size=128_256)


def by_hand(dim, n_layers, n_heads, n_kv_heads, ffn_hidden, vocab_size):
    """Llama parameters: per block q and o (dim x dim), k and v (dim x kv width), three FFN
    matrices (dim x ffn) and two norm weights; embedding and untied output (vocab x dim),
    final norm."""
    kv = dim // n_heads * n_kv_heads
    block = 2 * dim * dim + 2 * dim * kv + 3 * dim * ffn_hidden + 2 * dim
    return n_layers * block + 2 * vocab_size * dim + dim


def test_model_keys_build_that_model_and_the_planner_counts_it():
    cfg = load_config("debug_2d", ["--model.flavor=8B", *[f"--model.{k}={v}" for k, v in SHAPE.items()],
                                   "--parallelism.dp_shard=8", "--parallelism.tp=1"])
    model = recipe.build_model(cfg, tokenizer_vocab=1)
    assert sum(p.numel() for p in model.parameters()) == by_hand(**SHAPE)
    e = estimate_config(cfg, 8, 8, H100)
    # The estimate counts the model the config builds, not the 8B flavor's.
    assert e.memory.params == pytest.approx(4 * by_hand(**SHAPE) / e.layout.fsdp_shard / e.layout.tp, rel=0.02)
    assert resolve_model("8B", **SHAPE).n_params == by_hand(**SHAPE)


def test_a_planned_custom_shape_is_written_and_estimated_as_searched(tmp_path):
    job = Job(resolve_model("8B", **SHAPE), H100, 1, 8, 8192, 16)
    lay = next(lay for lay in candidates(job) if lay.tp == 2 and lay.pp == 1 and lay.ac == "full")
    (tmp_path / "custom.toml").write_text(to_toml(estimate(job, lay), job, "custom", "test"))
    got = estimate_config(load_config(tmp_path / "custom.toml"), 8, 8, H100)
    assert got.layout == lay and got.memory.total == estimate(job, lay).memory.total


@pytest.mark.slow  # a full-size dry run (fake tensors, one process): half a minute
def test_a_custom_shape_is_estimated_within_10_percent_of_its_dry_run():
    # The activation probe traces blocks of the custom shape, not the flavor's: tracing the
    # 8B flavor's blocks instead puts this point far outside.
    job = Job(resolve_model("8B", **SHAPE), H100, 1, 8, 8192, 16)
    lay = next(lay for lay in candidates(job) if lay.tp == 2 and lay.pp == 1 and lay.ac == "none"
               and lay.micro_batch == 2 and lay.strategy == "FULL_SHARD")
    e = estimate(job, lay)
    traced = trace(e, job)["memory"]["total"]
    assert traced == pytest.approx(e.memory.total, rel=0.10), f"{traced / e.memory.total - 1:+.1%}"


@pytest.mark.parametrize("overrides, message", [
    (["--model.name=gpt2", "--model.flavor=124M", "--model.ffn_hidden=100"],
     r"\[model\] ffn_hidden = 100: the gpt2 family has no such setting; its dimensions: n_layers, dim, n_heads"),
    (["--model.flavor=8B", "--model.dim=3000", "--model.n_heads=24"],
     r"\[model\] dim = 3000, n_heads = 24: the head size .* = 125 must be even"),
    (["--model.flavor=8B", "--model.n_kv_heads=5"], r"\[model\] n_kv_heads = 5: .*n_heads by n_kv_heads \(5\)"),
    (["--model.name=hf", f"--model.hf_config={ROOT / 'configs/hf/qwen2-tiny'}", "--model.dim=512"], r'\[model\] dim = 512: name = "hf" takes its dimensions from hf_config'),
])
def test_dimensions_a_family_cannot_take_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        recipe.build_model(load_config("debug_2d", overrides), tokenizer_vocab=1)


def test_plan_takes_the_dimensions_as_flags(capsys):
    args = ["--model", "8B", "--nodes", "1", "--seq-len", "8192", "--global-batch", "16", "--top", "1"]
    assert plan_run([*args, *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]]) == 0
    assert f"({by_hand(**SHAPE) / 1e9:.1f}B params)" in capsys.readouterr().out
    assert plan_run(["--model", "gpt2:124M", "--ffn-hidden", "10", *args[2:]]) == 2
    assert "--ffn-hidden: the gpt2 family has no such setting" in capsys.readouterr().err
