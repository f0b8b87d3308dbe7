"""A model family is a folder of code plus one registry line: a family defined in tests/
trains through train.py on dp 2 x tp 2 like plain PyTorch, and config validation reads
the registry."""

import pytest

from meshtrain.models import registry
from tests import train_oracle
from tests.forked_ranks import forked_ranks
from tests.toy_family import FAMILY
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config


@pytest.fixture(autouse=True)
def toy(monkeypatch):
    """Registered for each test only: the docs list the families of models/registry.py."""
    monkeypatch.setitem(registry.FAMILIES, FAMILY.name, FAMILY)


def args(out, name, *overrides):
    return ["--config", "debug_2d", "--model.name=toy", "--model.flavor=tiny", "--training.steps=6",
            "--training.seq_len=64", f"--job.output_dir={out}", f"--job.name={name}", *overrides]


@pytest.mark.slow
def test_a_family_outside_models_trains_through_train_py_like_plain_pytorch(tmp_path):
    save = ("--checkpoint.enable=true", "--checkpoint.interval=1000", "--checkpoint.last_save_model_only=true")
    proc = forked_ranks("tests/workers/toy_train.py", *args(tmp_path, "toy", *save), nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("meshtrain: DeviceMesh"))
    assert "tp=2" in header  # dp_shard 2 x tp 2: the family's TP plan was applied
    reference = train_oracle.oracle_for(*args(tmp_path, "ref"))
    train_oracle.assert_run_matches(tmp_path / "toy", reference, "toy dp2 x tp2")
    losses = train_oracle.logged(tmp_path / "toy", "loss")
    assert losses[-1] < losses[0] - 0.3


def test_config_validation_reads_the_registry():
    assert "toy" in registry.FAMILIES and load_config("debug_2d", ["--model.name=toy", "--model.flavor=tiny"])
    with pytest.raises(ConfigError, match="is not a toy flavor.*Accepted values: tiny"):
        load_config("debug_2d", ["--model.name=toy"])  # debug is a flavor of the others, not of toy
    with pytest.raises(ConfigError, match="Accepted values: .*gpt2.*toy"):
        load_config("debug_2d", ["--model.name=nosuch"])
