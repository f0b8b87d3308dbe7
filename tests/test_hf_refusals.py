"""`[model] name = "hf"`, one process: what is refused before any process group, and
why -- a TP plan style meshtrain does not translate, a tied embedding split unlike its
output layer, a Conv1D or a model without a TP plan under tp > 1, an architecture that
rescales its embeddings under a pipeline, block classes the model lacks, a config that is
not a causal LM, a missing transformers -- and what is no longer refused (GPT-NeoX's
"embedding_rowwise" under tp = 2)."""

from __future__ import annotations

from tests.conftest import dry_run_refusal
from tests.hf_configs import COMMON, extra_config, write_config


def refusal(tmp_path, *args: str) -> str:
    """The one-line error of a dry run of hf_debug at 4 ranks with ``args``."""
    return dry_run_refusal("--config", "hf_debug", "--world-size", "4", f"--job.output_dir={tmp_path}", *args)


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
    message = refusal(tmp_path, f"--model.hf_config={qwen3}", "--model.hf_tp_plan=layers.*.mlp=moe_tp_experts")
    assert "'layers.*.mlp=moe_tp_experts': meshtrain does not translate 'moe_tp_experts'" in message
    assert "expert parallelism" in message
    # An architecture whose own plan uses such a style: the entry, why, and the way out, which works.
    minicpm3 = extra_config(tmp_path, "minicpm3", **COMMON, model_type="minicpm3")
    message = refusal(tmp_path, f"--model.hf_config={minicpm3}")
    assert "MiniCPM3ForCausalLM's tensor-parallel plan has entries meshtrain does not translate: " \
           "layers.*.self_attn.kv_a_proj_with_mqa = 'mla_kv_a_proj': in multi-head latent attention" in message
    assert "Give [model] hf_tp_plan splitting only the MLP (gate/up colwise, down rowwise), or use tp = 1" in message
    mlp_only = "layers.*.mlp.gate_proj=colwise,layers.*.mlp.up_proj=colwise,layers.*.mlp.down_proj=rowwise"
    assert planned_tp_plan(f"--model.hf_config={minicpm3}", f"--model.hf_tp_plan={mlp_only}")


def planned_tp_plan(*args: str) -> dict:
    """The torch TP plan of hf_debug (dp 2 x tp 2) with ``args``, after its layout is
    planned for 4 ranks as train.py plans it (no process group)."""
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args

    cfg, _ = parse_args(["--config", "hf_debug", *args])
    model = recipe.build_model(cfg, 258)
    recipe.plan_layout(cfg, model, world_size=4, this_machine=False)
    return model.tp_plan(loss_parallel=True)


def test_gpt_neox_takes_tp_with_its_embedding_split_by_vocabulary_rows(tmp_path):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan = planned_tp_plan(f"--model.hf_config={write_config(tmp_path / 'gpt_neox', 'gpt_neox')}")
    embedding = plan["gpt_neox.embed_in"]  # "embedding_rowwise": ids whole, rows split, lookups summed
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
    assert embedding.output_layouts == (Replicate(),) and isinstance(plan["lm_head"].output_layouts[0], Shard)


def test_a_tied_embedding_split_unlike_its_output_layer_is_refused(tmp_path):
    qwen2 = str(write_config(tmp_path / "qwen2", "qwen2"))
    message = refusal(tmp_path, f"--model.hf_config={qwen2}",
                      "--model.hf_tp_plan=embed_tokens=embedding_colwise,layers.*.mlp.up_proj=colwise")
    assert "Qwen2ForCausalLM ties embed_tokens to lm_head, which meshtrain splits by vocabulary rows, but the " \
           "tensor-parallel plan gives embed_tokens = 'embedding_colwise'" in message
    assert "give [model] hf_tp_plan with embed_tokens=embedding_rowwise, or use tp = 1" in message


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
    assert f"transformers cannot build BertLMHeadModel from {odd}/config.json" in message and "(12)" in message


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
