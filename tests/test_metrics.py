import torch

from meshtrain.physics.gpus import gpu_of_device
from meshtrain.training.metrics import (
    MetricsLogger,
    device_peak_flops,
    flops_per_token,
    memory_stats,
    model_flops_per_token,
)


def test_flops_per_token_by_hand():
    # N = 1000, of which 100 embedding; L = 2, h = 8, s = 16:
    # 6 * 900 + 12 * 2 * 8 * 16 = 5400 + 3072
    assert flops_per_token(params=1000, embedding=100, tied_output=0, n_layers=2, dim=8, seq_len=16) == 8472.0
    # 40 of the embedding tied to the output layer: a matmul too, 6 * 940 + 3072
    assert flops_per_token(params=1000, embedding=100, tied_output=40, n_layers=2, dim=8, seq_len=16) == 8712.0


def _weights_multiplied(model) -> int:
    """By hand: the parameters of every module that is not a lookup table; a table tied
    to the output layer counts there (the same tensor is that Linear's weight)."""
    from torch import nn

    return sum(p.numel() for mod in model.modules() if not isinstance(mod, nn.Embedding)
               for p in mod.parameters(recurse=False))


def test_the_planner_and_the_trainer_count_the_same_flops_tied_and_untied():
    from meshtrain.models import registry
    from meshtrain.planning.shape import ModelShape

    seq = 256
    for family, tie in (("llama", None), ("gpt2", True), ("gpt2", False)):
        over = {} if tie is None else {"tie_embeddings": tie}
        model = registry.get(family).model_class().from_flavor("debug", meta=True, **over)
        c = model.cfg
        assert bool(model.tied_weights()) == bool(tie)
        by_hand = 6 * _weights_multiplied(model) + 12 * c.n_layers * c.dim * seq
        trainer = model_flops_per_token(model, seq)  # train.py's MFU, and the benchmarks'
        shape = ModelShape.from_model(model, flavor="debug", n_layers=c.n_layers, family=family,
                                      learned_positions=registry.get(family).learned_positions)
        planner = shape.flops_per_token(seq)         # the planner's MFU, and the dry run's estimate
        assert trainer == planner == by_hand, (family, tie, trainer, planner, by_hand)
        if tie is None:  # a native flavor, as the planner reads it from its name
            assert ModelShape.from_flavor("debug", family=family).flops_per_token(seq) == by_hand


def test_peak_flops():
    assert device_peak_flops(torch.device("cpu")) is None
    # The longest name that matches wins: a PCIe H100 is not read as an SXM one.
    assert gpu_of_device("NVIDIA H100 80GB HBM3").peak_bf16_flops == 989e12
    assert gpu_of_device("NVIDIA H100 PCIe").peak_bf16_flops == 756e12
    assert gpu_of_device("NVIDIA H100 NVL").peak_bf16_flops == 835e12
    assert gpu_of_device("NVIDIA A100-SXM4-80GB").peak_bf16_flops == 312e12
    assert gpu_of_device("NVIDIA GeForce RTX 4090") is None


def test_memory_stats_cpu():
    stats = memory_stats(torch.device("cpu"))
    assert stats["rss_gib"] > 0 and stats["peak_rss_gib"] >= stats["rss_gib"]


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


def test_rank0_writes_scalars_and_config(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, rank=0, log_freq=10, enable_tensorboard=True,
                           config_text="[training]\nlr = 3e-4")
    assert logger.should_log(1) and logger.should_log(20) and not logger.should_log(7)
    logger.log(1, {"loss": 3.21449, "lr": 3e-4, "grad_norm": 0.8123, "tokens_per_second": 12345.4,
                   "mfu": 41.23, "peak_gib": 1.234, "custom": 7})
    logger.log(10, {"loss": 2.5, "lr": 2e-4})
    logger.close()

    line = capsys.readouterr().out.splitlines()[0]
    assert line == ("step    1 | loss 3.2145 | lr 3.00e-04 | grad_norm 0.812 | tokens/s 12,345"
                    " | mfu 41.2% | mem 1.23 GiB | custom 7")

    acc = read_events(tmp_path)
    assert {"loss", "lr", "grad_norm", "tokens_per_second"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 10]
    assert [e.value for e in loss] == [torch.tensor(3.21449).item(), 2.5]  # stored as float32
    assert [e.value for e in acc.Scalars("lr")] == [torch.tensor(3e-4).item(), torch.tensor(2e-4).item()]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lr = 3e-4" in text and text.startswith("```")


def test_other_ranks_write_nothing(tmp_path, capsys):
    log_dir = tmp_path / "tb"
    logger = MetricsLogger(log_dir, rank=1, log_freq=1, enable_tensorboard=True, config_text="x")
    assert logger.should_log(1)  # same answer on every rank
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not log_dir.exists() and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def test_tensorboard_disabled(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "tb", rank=0, log_freq=1, enable_tensorboard=False)
    logger.log(5, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "tb").exists()
    assert "loss 1.0000" in capsys.readouterr().out
