"""`train.py` with the mixture of experts, one process: the moe/ scalars reach
TensorBoard, the loss falls, a resume continues the routing bias exactly, and bad [moe]
settings are refused before start-up, naming the key and the file."""

import pytest

from tests.in_process import refused, tiny_run, train_in_process
from tests.train_oracle import logged


def moe_run(tmp_path, name, *more):
    return tiny_run(tmp_path, name, "--training.seq_len=32", "--training.global_batch_size=4",
                    "--metrics.enable_tensorboard=true", "--metrics.log_freq=1", "--optimizer.lr=3e-3",
                    "--parallelism.ep=1", *more, config="moe_debug")


def test_moe_debug_trains_and_logs_the_expert_loads(tmp_path):
    result = train_in_process(*moe_run(tmp_path, "run", "--training.steps=8", "--checkpoint.enable=false"))
    assert result.code == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    losses = logged(run, "loss")
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    for layer in (1, 2, 3):  # block 0 is dense
        loads = logged(run, f"moe/load_max_over_mean/layer{layer}")
        assert len(loads) == 8 and all(1.0 <= v <= 8 / 2 for v in loads), loads  # at most E / top_k
        assert logged(run, f"moe/bias_max_abs/layer{layer}")[0] == pytest.approx(1e-3)  # one step of the bias
    balance = logged(run, "moe/balance_loss")
    assert all(3 * 0.99 <= v <= 3 * 4 for v in balance), balance  # 3 MoE layers, each from 1 to E / top_k
    assert logged(run, "moe/dropped_tokens") == [0.0] * 8
    assert "moe/balance_loss" in result.stdout and "layer1" not in result.stdout  # per-layer: TensorBoard only


def test_a_resumed_run_continues_the_routing_bias(tmp_path):
    """4 steps straight, and 2 + 2 with a checkpoint between: the same losses bitwise, which
    needs the bias (moved every step) saved and restored with the weights."""
    straight = train_in_process(*moe_run(tmp_path, "straight", "--training.steps=4",
                                         "--moe.bias_update_rate=0.05"))
    assert straight.code == 0, straight.stderr[-3000:]
    first = train_in_process(*moe_run(tmp_path, "resumed", "--training.steps=2", "--moe.bias_update_rate=0.05",
                                      "--checkpoint.if_config_differs=resume"))
    second = train_in_process(*moe_run(tmp_path, "resumed", "--training.steps=4", "--moe.bias_update_rate=0.05",
                                       "--checkpoint.if_config_differs=resume"))
    assert first.code == 0 and second.code == 0, second.stderr[-3000:]
    assert logged(tmp_path / "resumed", "loss") == logged(tmp_path / "straight", "loss")


@pytest.mark.parametrize("setting,needles", [
    ("top_k = 9", ["bad.toml: [moe] top_k = 9", "use 1 to 8"]),
    # moe_debug.toml's own top_k = 2 no longer fits: that file and key are named.
    ("n_experts = 1", ["moe_debug.toml: [moe] top_k = 2", "n_experts = 1"]),
    ("score_func = \"relu\"", ["bad.toml: [moe] score_func = \"relu\"", "softmax"]),
    ("balance_loss_coef = -3.0", ["bad.toml: [moe] balance_loss_coef = -3.0", ">= 0"]),
    ("n_dense_layers = 5", ["bad.toml: [moe] n_dense_layers = 5", "from 0 to n_layers = 4"]),
])
def test_bad_moe_settings_are_refused_naming_the_key(tmp_path, setting, needles):
    path = tmp_path / "bad.toml"
    path.write_text(f'extends = "{_shipped("moe_debug")}"\n[moe]\n{setting}\n')
    message = refused(train_in_process("--config", str(path)))
    for needle in needles:
        assert needle in message, message


def test_moe_settings_for_another_family_are_refused(tmp_path):
    message = refused(train_in_process(*tiny_run(tmp_path, "llama", "--moe.top_k=1")))
    assert "--moe.top_k=1 is for [model] name = \"moe\"" in message and 'name is "llama"' in message, message


def _shipped(name: str) -> str:
    from meshtrain.training.config_loader import CONFIGS_DIR

    return str(CONFIGS_DIR / f"{name}.toml")


def test_compiling_fp32_experts_is_refused_naming_both_keys():
    message = refused(train_in_process("--config", "moe_debug", "--compile.enable=true"))
    assert "--compile.enable=true" in message and 'mixed_precision_param = "float32"' in message, message
    assert "bfloat16" in message
