"""The model families: the one place the rest of meshtrain learns which models exist.

`train.py` (through training/recipe.py), the config schema, checkpoint export and the
planner read a family from here by its `[model] name`. A family is a folder of models/
(a torch-free module with its config dataclass and `FLAVORS`, a module with the
`nn.Module`) plus one `Family(...)` line below; code outside models/ can add one with
`register`. Everything is named by import path and loaded on first use, so importing the
registry -- and so reading a config -- does not import torch.

What the model class must answer (models/llama/model.py is the example):
    from_flavor(flavor, meta=True, **config overrides) -> the model on meta
    .cfg (the config dataclass: dim, n_layers, n_heads, head_dim, ffn_hidden, vocab_size,
    max_seq_len, tie_embeddings), init_weights(seed, device), fsdp_units(),
    transformer_blocks(), tp_plan(sequence_parallel=, loss_parallel=), tp_divisible(),
    tied_weights(), and pipeline_stage(layer_ids, first=, last=) for pipelines.

Optional -- the step calls them on each model part that has them (models/moe/model.py;
models/hf/model.py answers after_optimizer_step and metrics with the same expert loads):
    set_loss_scale(scale)       before a step's forwards: the factor summed token losses are
                                multiplied by (training/step.py token_loss_scale); a model that
                                adds a loss of its own from inside (a balance loss, injected in
                                backward) weighs it by this, so it means the same in every layout
    after_optimizer_step(sum_over)  after each optimizer step, on every rank: update state that
                                is not a parameter (a routing bias) from what the step saw,
                                summed over the data-parallel meshes in ``sum_over``
    active_parameters() -> int  parameters one token uses, when fewer than all (MFU counts these)
    metrics() -> {tag: value}   extra scalars to log on logged steps (after after_optimizer_step);
                                a tag several pipeline stages report is summed over them

Optional -- what expert parallelism (`[parallelism] ep`, parallel/expert_parallel.py) splits
(models/moe/model.py; models/hf/experts.py makes transformers' fused experts answer it):
    expert_modules() -> {name: module}  modules whose forward is forward(x_sorted,
                                tokens_per_expert) (rows grouped by expert) with weights
                                [n_experts, ...]; a model without it refuses ep > 1
    ep_divisible() -> {what: size}  the sizes ep must divide (the routed experts)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str                    # [model] name
    summary: str                 # one line, for the config reference
    config: str                  # "package.module:ConfigClass"; the module also holds FLAVORS
    model: str                   # "package.module:ModelClass"
    hf: str = ""                 # module with load_hf_weights_(model, dir) and save_hf(...), "" if none
    learned_positions: bool = False  # the position table is a weight: seq_len may not exceed it
    high_precision: tuple[str, ...] = ("output",)  # layers float8 training leaves alone
    output_layer: str = "output"  # the output projection's module name: [optimizer] name = "Muon" leaves it to AdamW

    def config_class(self) -> type:
        return _load(self.config)

    @property
    def flavors(self) -> dict:
        return importlib.import_module(self.config.partition(":")[0]).FLAVORS

    def model_class(self) -> type:
        return _load(self.model)

    def hf_module(self):
        return importlib.import_module(self.hf) if self.hf else None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "Llama 3 (rotary positions, GQA, SwiGLU)", "meshtrain.models.llama.config:LlamaConfig",
           "meshtrain.models.llama.model:Llama", hf="meshtrain.models.llama.hf"),
    Family("gpt2", "GPT-2 / GPT-3 shapes (learned positions, tied embeddings)", "meshtrain.models.gpt2.config:GPT2Config",
           "meshtrain.models.gpt2.model:GPT2", learned_positions=True, high_precision=("lm_head",),
           output_layer="lm_head"),
    Family("moe", "mixture of experts (DeepSeek-V3 / Qwen3-MoE shapes; Llama attention, routed + shared "
           "experts)", "meshtrain.models.moe.config:MoEConfig", "meshtrain.models.moe.model:MoETransformer"),
    Family("hf", "any Hugging Face causal LM, built from [model] hf_config", "meshtrain.models.hf.config:HFConfig",
           "meshtrain.models.hf.model:HFModel", hf="meshtrain.models.hf.weights", high_precision=("lm_head",),
           output_layer="lm_head"),
)}


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def register(family: Family) -> None:
    """Add a family defined outside models/ (your own model, a test's)."""
    FAMILIES[family.name] = family


def _load(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
