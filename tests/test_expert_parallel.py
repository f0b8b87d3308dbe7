"""`[parallelism] ep`: every layout expert parallelism cannot run is refused before start-up
with one line that names the key and shows the arithmetic (the layouts it does run are
proven against plain PyTorch in tests/test_parity.py: moe_ep*)."""

import pytest

from tests.conftest import dry_run_refusal

MOE = ["--config", "moe_debug", "--world-size", "4"]


@pytest.mark.parametrize("argv,needles", [
    # ep borrows its ranks from dp_shard: 4 % 3 != 0.
    ([*MOE, "--parallelism.ep=3"], ["[parallelism] ep = 3", "dp_shard=4", "4 % 3 = 1"]),
    # 6 routed experts do not split over 4 ranks.
    ([*MOE, "--parallelism.ep=4", "--moe.n_experts=6"], ["[parallelism] ep = 4", "routed experts (6)", "6 % 4 = 2"]),
    # A dense model has no experts to split.
    (["--config", "debug_2d", "--world-size", "4", "--parallelism.tp=1", "--parallelism.dp_shard=4",
      "--parallelism.ep=2"],
     ["[parallelism] ep = 2", "has none", "use ep = 1"]),
    # Plain replicas do not shard the experts over dp_shard / ep.
    ([*MOE, "--parallelism.sharding_strategy=NO_SHARD"], ["[parallelism] ep = 2", "NO_SHARD", "FULL_SHARD"]),
    # HSDP and context parallelism do not compose with ep yet.
    ([*MOE, "--world-size", "8", "--parallelism.dp_replicate=2"], ["[parallelism] ep = 2", "dp_replicate=2"]),
    ([*MOE, "--world-size", "8", "--parallelism.cp=2"], ["[parallelism] ep = 2", "cp=2"]),
    # One process keeps the file's ep = 2: dp_shard = 1 cannot lend it 2 ranks.
    (["--config", "moe_debug", "--parallelism.dp_shard=1"], ["[parallelism] ep = 2", "dp_shard=1"]),
])
def test_ep_layouts_that_cannot_run_are_refused_with_the_arithmetic(argv, needles):
    message = dry_run_refusal(*argv)
    assert len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message


def test_one_process_runs_moe_debug_with_ep_1():
    """The config's own one-process command (its comment, docs/moe.md) plans without error."""
    from meshtrain.training.config_loader import load_config
    from meshtrain.training.recipe import build_model, plan_layout

    cfg = load_config("moe_debug", ["--parallelism.dp_shard=1", "--parallelism.ep=1"])
    layout = plan_layout(cfg, build_model(cfg, 256), world_size=1, this_machine=False)
    assert (layout.dp_shard, layout.ep) == (1, 1)


def ep_all_to_all_bytes(moe_layers: int, tokens: int, top_k: int, dim: int, n_experts: int) -> tuple[int, int]:
    """docs/moe.md's traffic formula: per MoE layer and step, four all-to-alls (dispatch,
    combine, and their gradients) of tokens x top_k rows of dim fp32 numbers, and one of
    the n_experts int64 counts; whatever the routing. -> (count, payload bytes)."""
    return 5 * moe_layers, moe_layers * (4 * tokens * top_k * dim * 4 + n_experts * 8)


def test_dry_run_counts_the_dispatch_and_combine_all_to_alls():
    """The traced step's all-to-alls on the ep group, by the formula ((ep - 1) / ep of the
    bytes leave the rank at the dry run's even routing). tests/test_parity.py checks that a
    real step of the parity layout moe_ep2_fsdp4 sends what the same formula says."""
    from meshtrain.planning.dry_run import dry_run
    from meshtrain.training.config_loader import load_config

    report = dry_run(load_config("moe_debug", ["--training.seq_len=64"]), 4)
    count, payload, sent = report["comm"][("ep", "all-to-all")]
    # 8 sequences over 4 ranks: 2 each; the debug flavor: 3 MoE layers, top 2 of 8, dim 64.
    assert (count, payload) == ep_all_to_all_bytes(moe_layers=3, tokens=2 * 64, top_k=2, dim=64, n_experts=8)
    assert sent == payload * (2 - 1) / 2


def test_hf_moe_layouts_that_cannot_run_are_refused_naming_the_experts(tmp_path):
    """`[model] name = "hf"`: experts in a layout meshtrain does not split (gpt-oss keeps
    them transposed, with biases; JetMoE as its own module), and ep not dividing the
    experts -- each one line before any process group, so every rank stops at once."""
    from tests.hf_configs import ARCHS, COMMON, extra_config

    def refusal(hf: dict, *args: str) -> str:
        folder = extra_config(tmp_path, f"m{len(list(tmp_path.iterdir()))}", **hf)
        return dry_run_refusal("--config", "hf_moe_debug", "--world-size", "4", f"--job.output_dir={tmp_path}",
                               f"--model.hf_config={folder}", *args)

    gpt_oss = dict(COMMON, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                   layer_types=["full_attention"] * 2, attn_implementation="eager",
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    message = refusal(gpt_oss)
    for needle in ("[parallelism]", "ep = 2", "GptOssForCausalLM's experts are not in the layout meshtrain splits over ep=2",
                   "model.layers.0.mlp.experts (GptOssExperts: is_concatenated=False, is_transposed=True, has_bias=True)",
                   "use ep = 1"):
        assert needle in message, message
    jetmoe = dict(COMMON, model_type="jetmoe", num_local_experts=4, num_experts_per_tok=2, kv_channels=16)
    message = refusal(jetmoe)
    assert "JetMoeParallelExperts: not transformers' fused experts" in message and "use ep = 1" in message, message
    six = {**COMMON, **ARCHS["qwen3_moe"], "num_experts": 6}
    message = refusal(six, "--parallelism.ep=4")
    assert "[parallelism] ep = 4" in message and "routed experts (6)" in message and "6 % 4 = 2" in message, message
    message = refusal({**COMMON, **ARCHS["qwen3"]})  # a dense model has no experts to split
    assert "[parallelism] ep = 2" in message and "has none" in message and "use ep = 1" in message, message
