"""`meshtrain estimate`: the planner's numbers for one given config are the
search's numbers for that very layout, and what the formulas do not model is refused."""

import json
import tomllib

import pytest

from meshtrain.planning.estimate import NotModelled, estimate, estimate_config, main
from meshtrain.physics.gpus import get_gpu
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.report import to_toml
from meshtrain.planning.search import candidates
from meshtrain.planning.shape import Job
from meshtrain.training.config_loader import load_config

H100 = get_gpu("h100-80gb")


@pytest.mark.parametrize("pick", [
    dict(pp=1, tp=2, ac="selective", strategy="FULL_SHARD", micro_batch=1),
    dict(pp=4, tp=8, ac="full", strategy="SHARD_GRAD_OP", micro_batch=1, stages_per_rank=2),
], ids=["tp2-fsdp", "pp4-interleaved"])
def test_a_planner_written_config_is_estimated_as_the_search_ranked_it(tmp_path, pick):
    # A layout of the search, written as a train.py config and read back: the config ->
    # layout mapping must land on the very layout the search estimated.
    job = Job(resolve_model("70B"), H100, 8, 8, 8192, 64)
    lay = next(lay for lay in candidates(job) if all(getattr(lay, k) == v for k, v in pick.items()))
    text = to_toml(estimate(job, lay), job, "planned", "test")
    (tmp_path / "planned.toml").write_text(text)
    got = estimate_config(load_config(tmp_path / "planned.toml"), job.world, 8, H100)
    assert got.layout == lay
    assert got.memory.total == estimate(job, lay).memory.total
    assert tomllib.loads(text)["parallelism"]["tp"] == lay.tp


def test_what_the_formulas_lack_is_refused_by_name(capsys):
    with pytest.raises(NotModelled, match='mode = "selective", selective_every = 3'):
        estimate_config(load_config("debug_2d", ["--activation_checkpoint.mode=selective",
                                                 "--activation_checkpoint.selective_every=3"]), 4, 8, H100)
    assert main(["--config", "debug_2d", "--world-size", "3"]) == 2
    assert "--world-size 4" in capsys.readouterr().err


def test_json_has_every_category_and_the_fits_rule_the_dry_run_uses(capsys):
    assert main(["--config", "llama70b_2d", "--world-size", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["memory_gib"]) == {"params", "grads", "optimizer", "activations", "transient", "total"}
    assert d["usable_gib"] == pytest.approx(72.0) and d["fits"] == (d["memory_gib"]["total"] <= 72.0)
    assert d["tokens_per_s_per_gpu"] > 0 and 0 < d["mfu"] < 1


def test_config_keys_are_overridden_on_the_command_line_as_for_train_and_dry_run(capsys):
    # The same --section.key=value / --section.key value overrides as train and dry-run.
    assert main(["--config", "llama70b_2d", "--world-size", "64", "--json", "--parallelism.loss_parallel", "false"]) == 0
    gathered = json.loads(capsys.readouterr().out)
    assert main(["--config", "llama70b_2d", "--world-size", "64", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    # tp 8: each rank's loss runs over the whole vocabulary, its fp32 logits 8x larger
    assert gathered["memory_gib"]["activations"] > sharded["memory_gib"]["activations"] + 5
    assert main(["--config", "llama70b_2d", "--world-size", "64", "--parallelism.tpp=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain: error: ") and "Did you mean 'tp'?" in err
    assert main(["--config", "llama70b_2d", "--world-size", "64", "stray"]) == 2
    assert "unexpected argument 'stray'" in capsys.readouterr().err


def test_a_config_not_computing_in_bf16_is_estimated_with_a_warning(capsys):
    # debug_2d keeps train.py's defaults (fp32 parameters and reductions); the formulas time
    # bf16 matmuls and count bf16 gathers, so its estimate says it is not that config's. The
    # reduce dtype is planned as set: a bf16 reduction alone warns of nothing.
    assert main(["--config", "debug_2d", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert 'WARNING: [training] mixed_precision_param = "float32": the estimate assumes "bfloat16"' in out
    assert main(["--config", "llama70b_2d", "--world-size", "64"]) == 0
    assert "mixed_precision" not in capsys.readouterr().out
    assert main(["--config", "llama70b_2d", "--world-size", "64", "--training.mixed_precision_reduce=bfloat16"]) == 0
    assert "mixed_precision" not in capsys.readouterr().out
