"""Models as FSDP1 / Accelerate users bring them: transformers' own GPT2LMHeadModel and
LlamaForCausalLM, from a tiny config, given to `parallelize` with the block class and
(for TP) a plan in Hugging Face module names -- no wrapper, no meshtrain methods.

Every layout is judged by tests/oracle.py: the same Hugging Face class, loaded with the
layout's initial full weights and trained in plain PyTorch with clipping that binds.
The refusals (a TP plan that matches nothing, a TP style on a module it cannot split)
and the forward outputs train_step accepts are checked in one process."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from meshtrain.parallel import LayoutError, ParallelDims, parallelize
from meshtrain.parallel.init import canonical_name
from tests.conftest import train_layouts
from tests.oracle import assert_clipping_binds, assert_matches, run_oracle
from tests.workers import hf_models
from meshtrain.training.step import pipeline_loss_fn, train_step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 4-process torchrun job trains every layout in turn."""
    return train_layouts("tests/workers/hf_models.py", tmp_path_factory.mktemp("hf_models"), hf_models.LAYOUTS,
                         nproc=4)


_oracles: dict[str, tuple[dict, object]] = {}


def oracle_for(family: str, init: dict):
    """Plain PyTorch on the same Hugging Face class and config, started from ``init`` (run
    once per family while its layouts start from the same weights bitwise)."""
    if family in _oracles:
        seen, judge = _oracles[family]
        if seen.keys() == init.keys() and all(torch.equal(seen[name], init[name]) for name in init):
            return judge

    def make_model():
        model = hf_models.build(family, seed=1)  # other weights, so the copy below must happen
        params = dict(model.named_parameters())
        assert set(params) == set(init), f"parameter names differ: {set(params) ^ set(init)}"
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(init[name])
        return model

    tokens = hf_models.batches()
    steps = [[(t[:, :-1], t[:, 1:])] for t in tokens]
    judge = run_oracle(make_model, steps, with_unclipped=True, lr=hf_models.LR, max_norm=hf_models.MAX_NORM,
                       weight_decay=hf_models.WEIGHT_DECAY)
    _oracles[family] = (init, judge)
    return judge


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(hf_models.LAYOUTS))
def test_hf_model_layout_matches_plain_pytorch(runs, layout):
    got = runs[layout]
    oracle = oracle_for(hf_models.LAYOUTS[layout][1], got["init"])
    assert_clipping_binds(oracle, layout)
    assert_matches(got["losses"], got["grad_norms"], got["final"], oracle, layout)
    assert got["losses"][-1] < got["losses"][0] - 0.1, f"{layout}: did not learn"
    plan = hf_models.LAYOUTS[layout][2].get("tp_plan", {})
    want = sorted(f"{key.replace('*', str(i))}.weight" for key in plan for i in range(hf_models.N_LAYERS))
    assert got["tp_sharded"] == want, f"{layout}: TP split {got['tp_sharded']}, the plan names {want}"


# ---- one process: what parallelize refuses, and what it wraps ----

def _hf_tp_plan_keys(config) -> dict:
    """transformers' own TP plan for the model's base (strings such as "colwise"), as
    ParallelStyles -- but with its keys as they are, relative to the base model."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {key: styles[value.split("_")[0]]() for key, value in config.base_model_tp_plan.items()}


def _nothing_sharded(model: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters())


def test_hf_base_model_tp_plan_on_the_causal_lm_root_is_refused_naming_the_right_paths(fake_world):
    fake_world(4)
    mesh = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    model = hf_models.build("llama")
    plan = _hf_tp_plan_keys(model.config)  # "layers.*.self_attn.q_proj": the layers are under "model."
    with pytest.raises(LayoutError) as err:
        parallelize(model, mesh, tp_plan=plan, block_classes=(LlamaDecoderLayer,))
    message = str(err.value)
    for key in plan:
        assert f"'{key}' matches no module" in message
        assert f"model.{key}" in message, f"no suggestion for {key}: {message}"
    assert _nothing_sharded(model)
    # The same keys under "model." are accepted.
    parallelize(model, mesh, tp_plan={f"model.{k}": v for k, v in plan.items()},
                block_classes=(LlamaDecoderLayer,))
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)


def test_tp_style_on_a_module_it_cannot_split_is_refused_before_sharding(fake_world):
    fake_world(4)
    mesh = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    model = hf_models.build("gpt2")
    # GPT-2's Conv1D stores its weight [in, out]: a column split would cut the wrong dim.
    plan = {"transformer.h.*.mlp.c_fc": ColwiseParallel(), "transformer.h.*.attn.c_attn": ColwiseParallel()}
    with pytest.raises(LayoutError) as err:
        parallelize(model, mesh, tp_plan=plan, block_classes=(GPT2Block,))
    message = str(err.value)
    assert "transformer.h.0.mlp.c_fc (and 1 more)" in message and "transformer.h.0.attn.c_attn" in message
    assert "transformers.pytorch_utils.Conv1D" in message and "nn.Linear" in message
    assert _nothing_sharded(model)


def test_plan_values_must_be_parallel_styles(fake_world):
    fake_world(2)
    mesh = ParallelDims(dp_shard=1, tp=2).build_mesh("cpu")
    model = hf_models.build("llama")
    plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}  # "colwise" strings
    with pytest.raises(LayoutError, match="'colwise' is not a ParallelStyle"):
        parallelize(model, mesh, tp_plan=plan)
    assert _nothing_sharded(model)


@pytest.mark.parametrize("how", ["block_classes", "blocks_list", "blocks_container"])
def test_checkpointing_wraps_each_block_in_its_parent_and_fsdp_wraps_the_wrapper(fake_world, how):
    fake_world(2)
    mesh = ParallelDims(dp_shard=2).build_mesh("cpu")
    model = hf_models.build("gpt2")
    names = [name for name, _ in model.named_parameters()]
    blocks = {"block_classes": None, "blocks_list": list(model.transformer.h),
              "blocks_container": model.transformer.h}[how]
    parallelize(model, mesh, block_classes=(GPT2Block,), blocks=blocks, activation_checkpoint="full")
    for block in model.transformer.h:
        assert isinstance(block, CheckpointWrapper) and isinstance(block, FSDPModule), type(block)
        assert not isinstance(block._checkpoint_wrapped_module, FSDPModule)
    assert [canonical_name(name) for name, _ in model.named_parameters()] == names


def test_compile_replaces_each_block_in_its_parent(fake_world):
    fake_world(2)
    mesh = ParallelDims(dp_shard=2).build_mesh("cpu")
    model = hf_models.build("llama")
    names = [name for name, _ in model.named_parameters()]
    parallelize(model, mesh, block_classes=(LlamaDecoderLayer,), activation_checkpoint="selective",
                compile=True)  # compiled lazily: nothing runs here
    first, second = model.model.layers
    assert isinstance(first, torch._dynamo.eval_frame.OptimizedModule) and isinstance(first, FSDPModule)
    assert isinstance(first._orig_mod, CheckpointWrapper)  # selective: every 2nd block, from the first
    assert isinstance(second._orig_mod, LlamaDecoderLayer)
    assert [canonical_name(name) for name, _ in model.named_parameters()] == names


def test_checkpointing_without_a_way_to_find_the_blocks_says_what_to_pass(fake_world):
    fake_world(2)
    mesh = ParallelDims(dp_shard=2).build_mesh("cpu")
    with pytest.raises(ValueError, match="pass blocks="):
        parallelize(hf_models.build("gpt2"), mesh, min_num_params=1000, activation_checkpoint="full")


# ---- one process: forwards that return an output object or a dict ----

class _Returns(nn.Module):
    """A tiny LM whose forward returns its logits as ``kind`` says."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head, self.kind = nn.Embedding(32, 16), nn.Linear(16, 32), kind

    def forward(self, tokens):
        logits = self.head(self.embed(tokens))
        if self.kind == "dict":
            return {"loss": None, "logits": logits}
        if self.kind == "object":
            return SimpleNamespace(loss=None, logits=logits)
        return logits


def test_train_step_takes_logits_from_a_dict_or_an_output_object():
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    results = {}
    for kind in ("tensor", "dict", "object"):
        model = _Returns(kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        results[kind] = [train_step(model, optimizer, batch, max_norm=1.0) for _ in range(2)], model.head.weight
    for kind in ("dict", "object"):
        assert results[kind][0] == results["tensor"][0]
        assert torch.equal(results[kind][1], results["tensor"][1])
    hf_output = hf_models.build("gpt2")(tokens[:, :-1])  # a CausalLMOutput: a dict and an object
    loss = pipeline_loss_fn(2)(hf_output, tokens[:, 1:])
    assert torch.allclose(loss, pipeline_loss_fn(2)(hf_output.logits, tokens[:, 1:]))
    with pytest.raises(TypeError, match="needs the logits"):
        pipeline_loss_fn(1)((hf_output.logits,), tokens[:, 1:])
