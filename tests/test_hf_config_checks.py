"""A Hugging Face config.json that transformers reads but cannot run, and weight files
that cannot be read, are refused before any process group, naming the key or the file:
an unknown RoPE type (a bare KeyError from transformers' rotary class before), key/value
heads that do not divide the heads (a shape error in the first forward before), a router
auxiliary loss asked for that meshtrain would not add (silently ignored before), a
truncated safetensors file, an index naming a shard that is missing or that lacks a
tensor, an index that is not JSON (a SafetensorError traceback from every rank before)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import dry_run_refusal
from tests.hf_configs import COMMON, extra_config
from tests.in_process import refused, tiny_run, train_in_process

ONE_RANK = ("--world-size", "1", "--parallelism.tp=1", "--parallelism.dp_shard=1")


def hf_refusal(tmp_path, folder: str) -> str:
    return dry_run_refusal("--config", "hf_debug", *ONE_RANK, f"--job.output_dir={tmp_path}",
                           f"--model.hf_config={folder}")


@pytest.mark.parametrize("key,rope", [
    ("rope_scaling", {"rope_type": "wobbly", "factor": 2.0}),
    ("rope_scaling", {"type": "wobbly", "factor": 2.0}),         # the older spelling of the type
    ("rope_parameters", {"rope_type": "wobbly", "rope_theta": 10000.0}),
])
def test_a_rope_type_transformers_does_not_know_is_refused_naming_the_key_and_the_file(tmp_path, key, rope):
    folder = extra_config(tmp_path, "rope", **COMMON, model_type="llama", **{key: rope})
    message = hf_refusal(tmp_path, folder)
    assert f"{folder}/config.json: {key} has rope type \"wobbly\"" in message, message
    assert "llama3" in message and "yarn" in message  # what it knows


def test_key_value_heads_that_do_not_divide_the_heads_are_refused_naming_both(tmp_path):
    folder = extra_config(tmp_path, "gqa", **{**COMMON, "num_key_value_heads": 3}, model_type="llama")
    message = hf_refusal(tmp_path, folder)
    assert f"{folder}/config.json: num_key_value_heads = 3 does not divide num_attention_heads = 4" in message
    assert "(1, 2, 4)" in message


def test_a_router_auxiliary_loss_meshtrain_would_not_add_is_refused(tmp_path):
    from tests.hf_configs import ARCHS

    folder = extra_config(tmp_path, "aux", **{**COMMON, **ARCHS["qwen3_moe"]}, output_router_logits=True)
    message = hf_refusal(tmp_path, folder)
    assert f"{folder}/config.json: output_router_logits = true" in message and "router_aux_loss_coef = 0.001" in message
    assert "set output_router_logits to false" in message


def test_a_known_rope_type_and_grouped_heads_still_build(tmp_path):
    from meshtrain.models.hf.model import build_hf

    folder = extra_config(tmp_path, "fine", **COMMON, model_type="llama",
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert build_hf(folder).cfg.n_kv_heads == 2


# ---------------------------------------------------------------- initial_load_hf's weight files

def _hf_folder(tmp_path):
    """A Hugging Face folder of the debug Llama that tiny_run builds (the config matches, so
    only the weight files can be wrong); returns (folder, its tensors)."""
    from safetensors.torch import save_file

    from meshtrain.models.llama.hf import config_to_hf, to_hf_name
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import load_config

    cfg = load_config("debug_2d", tiny_run(tmp_path)[2:])
    model = recipe.build_model(cfg, 258)
    model.init_weights(seed=0)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.cfg)))
    tensors = {to_hf_name(n): p.detach().contiguous() for n, p in model.named_parameters()}
    return folder, tensors, save_file


def _truncated(folder, tensors, save_file):
    save_file(tensors, str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])  # an interrupted download
    return "model.safetensors", "truncated"


def _index(folder, tensors, save_file, *, shards: int, weight_map=None):
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:len(names) // 2]}, str(folder / "model-00001-of-00002.safetensors"))
    if shards == 2:
        save_file({n: tensors[n] for n in names[len(names) // 2:]}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = weight_map or {n: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors"
                                for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _missing_shard(folder, tensors, save_file):
    _index(folder, tensors, save_file, shards=1)
    return "model.safetensors.index.json", "model-00002-of-00002.safetensors, which is missing"


def _shard_lacks_a_tensor(folder, tensors, save_file):
    names = sorted(tensors)
    _index(folder, tensors, save_file, shards=2,
           weight_map={n: "model-00001-of-00002.safetensors" for n in names})  # all in the first
    return "model.safetensors.index.json", "which does not hold it"


def _index_not_json(folder, tensors, save_file):
    _index(folder, tensors, save_file, shards=2)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    return "model.safetensors.index.json", "is not a safetensors index"


@pytest.mark.parametrize("harm", [_truncated, _missing_shard, _shard_lacks_a_tensor, _index_not_json])
def test_unreadable_weight_files_are_refused_before_the_run_starts(tmp_path, harm):
    folder, tensors, save_file = _hf_folder(tmp_path)
    file, said = harm(folder, tensors, save_file)
    result = train_in_process(*tiny_run(tmp_path, "hf", "--training.steps=1",
                                        f"--checkpoint.initial_load_hf={folder}"))
    message = refused(result)
    assert "[checkpoint] initial_load_hf" in message and str(folder / file) in message and said in message, message
    assert "step    1" not in result.stdout and not (tmp_path / "hf" / "checkpoint").exists()


def test_intact_weight_files_in_two_shards_load(tmp_path):
    folder, tensors, save_file = _hf_folder(tmp_path)
    _index(folder, tensors, save_file, shards=2)
    result = train_in_process(*tiny_run(tmp_path, "hf", "--training.steps=1",
                                        f"--checkpoint.initial_load_hf={folder}"))
    assert result.code == 0, result.stderr[-2000:]
