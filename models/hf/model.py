"""A transformers causal LM as a meshtrain model, built on meta from its config.json.

The model *is* transformers' class (`Qwen2ForCausalLM`, ...), subclassed once to add what
parallel/ asks of a model (see models/registry.py), so its parameter names are the Hugging
Face ones: a checkpoint exports by copying names, and safetensors weights load the same way.
Everything it needs comes from transformers' own description of the architecture:

    _no_split_modules          the transformer block classes (FSDP units, AC, compile)
    base_model_tp_plan         which projections split how (tp_styles.py: as torch styles)
    base_model_pp_plan         embeddings / layers / norm (where a pipeline cuts)
    _init_weights(module)      the architecture's initial distribution

Sequence parallelism is not applied: transformers builds rotary tables and the causal mask
from the sequence length of the hidden states it is given, so the sequence stays whole
between blocks (the norms run unsplit; attention and MLP split by heads and width).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.models.common import fsdp_units, vocab_parallel_ends
from meshtrain.models.hf.config import HFConfig, HFModelError, config_path, read_hf_config
from meshtrain.models.hf.config_checks import config_problem, file_problem
from meshtrain.models.hf.experts import RoutedExperts, plan_addresses, route_experts_
from meshtrain.models.hf.tp_styles import STYLES, refusal, translate
from meshtrain.models.moe.loads import load_scalars, summed_loads
from meshtrain.parallel.init import canonical_name, copy_block_, materialize, param_seed
from meshtrain.parallel.lora import init_adapters_
from meshtrain.parallel.mesh import LayoutError

def transformers_or_explain():
    """The transformers module, or HFModelError saying what to install."""
    try:
        import transformers
    except ImportError:
        raise HFModelError('[model] name = "hf" builds the model with transformers, which is not installed: '
                          'pip install "meshtrain[hf]" (or pip install transformers)') from None
    return transformers


def causal_lm_class(hf: dict):
    """transformers' causal-LM class for a config dict; HFModelError when there is none."""
    transformers = transformers_or_explain()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = hf["model_type"]
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFModelError(f"model_type \"{kind}\" is not a causal language model that transformers "
                         f"{transformers.__version__} knows (AutoModelForCausalLM has no class for it); "
                         f"causal LMs include llama, qwen2, mistral, gemma, phi3, olmo2, gpt2")
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])


def build_hf(where: str, *, hf: dict | None = None, n_layers: int = 0, block_classes: tuple[str, ...] = (),
             tp_plan: dict[str, str] | None = None) -> nn.Module:
    """The model of the config.json at ``where`` (or of the dict ``hf``) on meta: nothing
    allocated or downloaded. ``n_layers`` (0: the config's) shortens it; ``block_classes``
    (class names) replace ``_no_split_modules``; ``tp_plan`` (pattern -> transformers' style
    word, relative to the base model) replaces ``base_model_tp_plan``."""
    hf = hf if hf is not None else read_hf_config(where)
    cls = causal_lm_class(hf)
    path = str(config_path(where)) if where else "the model's config.json"
    problem = file_problem(cls.config_class, hf, path)
    if problem:
        raise HFModelError(problem)
    # transformers checks a config as it reads it and builds the model: a ValueError says
    # what is wrong. A number of the wrong type or a zero it divides by is the file's
    # fault too, and so reported, not a traceback.
    try:
        config = cls.config_class.from_dict({**hf, **({"num_hidden_layers": n_layers} if n_layers else {})})
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as err:
        raise HFModelError(f"transformers cannot read {path} as a {cls.config_class.__name__}: {err}") from None
    # What transformers accepts here but would fail on in the first forward.
    problem = config_problem(config, hf, path)
    if problem:
        raise HFModelError(problem)
    config.use_cache = False
    if getattr(config, "_attn_implementation", None) in (None, "flash_attention_2", "flash_attention_3"):
        config._attn_implementation = "sdpa"  # no extra package; flash kernels through torch's SDPA
    try:
        with torch.device("meta"):
            model = cls(config)
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as err:
        raise HFModelError(f"transformers cannot build {cls.__name__} from {path}: {err}") from None
    model.__class__ = _meshtrain_class(cls)
    model._mt_setup(config, block_classes, tp_plan)
    return model


HEAD = "lm_head"  # the output layer of every transformers causal LM
_CLASSES: dict[type, type] = {}


def _meshtrain_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (HFModel, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def _sizes(config) -> dict:
    """The sizes meshtrain reads (HFConfig's), from a transformers config."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return dict(dim=text.hidden_size, n_layers=text.num_hidden_layers, n_heads=heads,
                n_kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                ffn_hidden=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
                vocab_size=text.vocab_size,
                max_seq_len=getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", 0) or 0,
                tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)))


class HFModel:
    """What meshtrain adds to a transformers causal LM (mixed in before its class)."""

    def _mt_setup(self, config, block_classes, tp_plan) -> None:
        self.cfg = HFConfig(hf=config.to_dict(), **_sizes(config))
        self._mt_first, self._mt_last = True, True
        self._mt_pass_through: bool | None = None  # see layout_refusal
        self._mt_tied_sources: dict[str, tuple[str, nn.Module]] = {}
        base = self.base_model
        self._mt_base = next(name for name, m in self.named_children() if m is base)
        names = tuple(block_classes) or tuple(getattr(self, "_no_split_modules", None) or ())
        blocks = [m for m in self.modules() if type(m).__name__ in names]
        if not blocks:
            present = sorted({type(m).__name__ for m in self.modules()})
            near = [n for n in present if "Layer" in n or "Block" in n] or present
            raise HFModelError(f"block classes {list(names)} are not in {type(self).__name__} "
                               f"(set [model] hf_block_classes; classes it has: {', '.join(near)})")
        # The blocks' container (layers, h, ...), a child of the base model.
        self._mt_layers = next((n for n, m in base.named_children()
                                if isinstance(m, nn.ModuleList) and any(b is blocks[0] for b in m)), None)
        if self._mt_layers is None:
            raise HFModelError(f"block classes {list(names)}: {type(blocks[0]).__name__} is not the repeated layer "
                               f"of {type(base).__name__} (an item of a ModuleList it holds); name the decoder-layer "
                               "class in [model] hf_block_classes")
        embedding = self.get_input_embeddings()
        self._mt_embed_weight = next(n for n, p in self.named_parameters() if p is embedding.weight)
        # The embedding's path from the base model, as TP plans name it ("embed_tokens").
        self._mt_embed_path = next((n for n, m in base.named_modules() if m is embedding), None)
        self._mt_embed, self._mt_norm = _ends(base, getattr(config, "base_model_pp_plan", None) or {},
                                              self._mt_layers, self._mt_embed_path)
        plan = tp_plan if tp_plan is not None else dict(getattr(config, "base_model_tp_plan", None) or {})
        # Routed experts in transformers' fused layout run as meshtrain's (experts.py): whole
        # on every TP rank -- each routes the same tokens -- and split by expert parallelism.
        routed, self._mt_unknown_experts = route_experts_(self)
        self._mt_n_experts = next((m.gate_up_proj.shape[0] for m in routed.values()), 0)
        paths = [name.removeprefix(f"{self._mt_base}.") for name in routed]
        self._mt_tp_words = {key: word for key, word in plan.items() if not plan_addresses(key, paths)}

    def layout_refusal(self, *, tp: int, pp: int, ep: int = 1) -> str | None:
        """Why this model cannot take these degrees (checked before any process group), or None."""
        name = type(self).__name__
        if ep > 1 and self._mt_unknown_experts:
            return self._unknown_experts_refusal(ep)
        if tp > 1:
            if not self._mt_tp_words:
                return (f"{name} has no tensor-parallel plan (its config has no base_model_tp_plan): "
                        "give [model] hf_tp_plan, or use tp = 1 (FSDP alone trains it)")
            untranslated: dict[str, list[str]] = {}
            for key, word in self._mt_tp_words.items():
                if word not in STYLES:
                    untranslated.setdefault(word, []).append(key)
            if untranslated:
                return (f"{name}'s tensor-parallel plan has entries meshtrain does not translate: "
                        f"{refusal(untranslated)}")
            tied = self._tied_split_refusal()
            if tied:
                return tied
        if pp > 1:
            if self._mt_embed is None:
                return (f"{name} has no base_model_pp_plan (embeddings / layers / norm), so meshtrain "
                        "does not know where a pipeline stage starts and ends; use pp = 1")
            if self._mt_pass_through is None:  # once per model: a CPU forward of its front
                self._mt_pass_through = _embeddings_pass_through(self)
            if not self._mt_pass_through:
                return (f"{name} transforms its embeddings in forward before the first block (e.g. a "
                        "scale), so a pipeline stage after the first cannot take hidden states as "
                        "inputs_embeds; use pp = 1 for this architecture")
        return None

    # ---- forward: token ids (or a stage's incoming hidden states) -> logits (or hidden states) ----

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` [b, s]: packed documents (models/documents.py), handed to
        transformers as ``position_ids``. With no attention mask and no cache its masking
        utilities (masking_utils.find_packed_sequence_indices) read the documents from
        them -- a new one wherever a position does not follow the last -- and build the
        mask for sdpa or eager attention themselves; rotary angles follow the positions."""
        given = {"input_ids": tokens} if self._mt_first else {"inputs_embeds": tokens}
        if positions is not None:
            given["position_ids"] = positions
        if not self._mt_last:
            return getattr(self, self._mt_base)(**given).last_hidden_state
        return super().forward(**given).logits

    # ---- what parallel/ needs to know ----

    def _layers(self) -> nn.ModuleList:
        return getattr(getattr(self, self._mt_base), self._mt_layers)

    def transformer_blocks(self) -> nn.ModuleList:
        return self._layers()

    def fsdp_units(self) -> list:
        base = getattr(self, self._mt_base)
        embed = getattr(base, self._mt_embed) if self._mt_embed else None
        norm = getattr(base, self._mt_norm) if self._mt_norm else None
        head = [m for m in (norm, self._head()) if m is not None and any(True for _ in m.parameters())]
        # Without a known embedding, a tied output layer stays with it in the root unit.
        head = head if embed is not None or not self.cfg.tie_embeddings else []
        return fsdp_units(list(self._layers()), [embed], head, tied=self.cfg.tie_embeddings)

    def tied_weights(self) -> list[tuple[str, ...]]:
        if not self.cfg.tie_embeddings:
            return []
        return [(self._mt_embed_weight, f"{HEAD}.weight")]

    def _head(self) -> nn.Module | None:
        return getattr(self, HEAD, None)

    def expert_modules(self) -> dict[str, nn.Module]:
        """The routed experts of each MoE layer on this part, by module name (experts.py's
        `RoutedExperts`: forward(x_sorted, tokens_per_expert), weights [n_experts, ...])."""
        return {name: m for name, m in self.named_modules() if isinstance(m, RoutedExperts)}

    def ep_divisible(self) -> dict[str, int] | None:
        """What expert parallelism splits: the routed experts; None when there are none it can
        split (a dense model; experts in another layout, which layout_refusal names)."""
        return {"routed experts": self._mt_n_experts} if self._mt_n_experts else None

    # ---- the optional calls of training/step.py (models/registry.py) ----

    def expert_layers(self) -> dict[str, RoutedExperts]:
        """The routed experts of each MoE layer on this part, by layer index ("1")."""
        out = {}
        for index, block in self._layers().named_children():
            experts = next((m for m in block.modules() if isinstance(m, RoutedExperts)), None)
            if experts is not None:
                out[index] = experts
        return out

    @torch.no_grad()
    def after_optimizer_step(self, sum_over=()) -> None:
        """Sum the step's expert loads over the data-parallel meshes ``sum_over`` and keep
        them for `metrics` (``last_loads``: layer indices, [layers, experts]), as the native
        family does (models/moe/loads.py). No balancing
        state: transformers' routers have no bias, and its auxiliary loss is not added."""
        layers = self.expert_layers()
        if layers:
            loads = summed_loads([m.take_loads() for m in layers.values()], sum_over)
            self.last_loads = (list(layers), loads)  # read (a device sync) only when logged

    def metrics(self) -> dict[str, float]:
        """The moe/ scalars of the last step (docs/moe.md): each layer's load, dropped tokens."""
        if getattr(self, "last_loads", None) is None:
            return {}
        return {**load_scalars(*self.last_loads), "moe/dropped_tokens": 0.0}  # dropless: never one

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (what MFU
        counts, training/metrics.py); ``num_experts_per_tok`` of the config's experts."""
        total = sum(p.numel() for p in self.parameters())
        k = getattr(self.config.get_text_config(), "num_experts_per_tok", None)
        if not k:
            return total
        per_expert = lambda m: sum(math.prod(p.shape[1:]) for p in (m.gate_up_proj, m.down_proj))
        return total - sum(per_expert(m) * (m.gate_up_proj.shape[0] - k) for m in self.expert_modules().values())

    def _unknown_experts_refusal(self, ep: int) -> str:
        found = self._mt_unknown_experts
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        return (f"{type(self).__name__}'s experts are not in the layout meshtrain splits over ep={ep} (transformers' fused "
                f"experts: gate_up_proj [experts, 2 x width, dim] and down_proj [experts, dim, width], no bias, "
                f"not transposed): {found[0]}{more}; use ep = 1 (FSDP shards them whole)")

    def tp_divisible(self) -> dict[str, int]:
        c = self.cfg
        return {"heads": c.n_heads, "kv heads": c.n_kv_heads, "FFN width": c.ffn_hidden, "vocab size": c.vocab_size}

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> dict:
        """transformers' plan, in torch styles, plus the vocabulary split of the output
        layer and (where the plan does not say how to split it) of the embedding, as in
        meshtrain's own models. ``sequence_parallel`` is not applied (module docstring)."""
        why = self.layout_refusal(tp=2, pp=1)
        if why:
            raise LayoutError(why)
        base = getattr(self, self._mt_base)
        has_embedding = self._mt_embed_path is not None and _holds(base, self._mt_embed_path)
        plan = {}
        for key, word in self._mt_tp_words.items():
            if key.split(".")[0] == self._mt_layers and not len(self._layers()):
                continue  # a pipeline stage without blocks
            if key == self._mt_embed_path and not has_embedding:
                continue  # a pipeline stage after the first
            if translate(word) is not None:
                for each in self._blocks_holding(key):
                    plan[f"{self._mt_base}.{each}"] = translate(word)  # a style per key: torch's keep state
        if self._mt_embed is None:  # the ends stay whole (FSDP shards them); the logits are plain
            return plan
        embedding, output = vocab_parallel_ends(sequence_parallel=False, loss_parallel=loss_parallel)
        if has_embedding and self._mt_embed_path not in self._mt_tp_words:
            plan[f"{self._mt_base}.{self._mt_embed_path}"] = embedding
        if self._head() is not None:
            plan[HEAD] = output
        return plan

    def tp_reductions(self) -> list[tuple[int, int]] | None:
        """Per block, (column-split, row-split) Linears of transformers' TP plan; None where
        the model has no TP plan. No module of these plans prepares its input as a DTensor,
        so each column-split Linear all-reduces its own input gradient in backward and each
        row-split one its output in forward: the planner counts them
        (planning/step_time.py's `tp_collectives`)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        try:
            plan = self.tp_plan()
        except LayoutError:
            return None
        prefix = f"{self._mt_base}.{self._mt_layers}."
        counts = [[0, 0] for _ in self._layers()]
        for key, style in plan.items():
            if not key.startswith(prefix) or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue
            which, _, rest = key.removeprefix(prefix).partition(".")
            for i, block in enumerate(self._layers()):
                if which in ("*", str(i)) and _holds(block, rest):
                    counts[i][isinstance(style, RowwiseParallel)] += 1
        return [tuple(c) for c in counts]

    def _blocks_holding(self, key: str) -> list[str]:
        """``key`` ("layers.*.mlp.gate_proj"), or where only some blocks hold that module (a
        mixture of experts' dense blocks), one key per block that does ("layers.0.mlp.gate_proj"):
        torch warns of a pattern that misses in some blocks."""
        parts = key.split(".")
        if len(parts) < 3 or parts[0] != self._mt_layers or parts[1] != "*" or "*" in parts[2:]:
            return [key]
        rest = ".".join(parts[2:])
        holding = [i for i, block in self._layers()._modules.items() if _holds(block, rest)]
        return [key] if len(holding) == len(self._layers()) else [f"{parts[0]}.{i}.{rest}" for i in holding]

    def _tied_split_refusal(self) -> str | None:
        """A tied embedding and output layer are one weight, so TP must split them alike:
        the output layer by vocabulary rows (meshtrain's, when the embedding is known from
        the pipeline plan) or not at all. Why the plan's embedding entry does not, or None."""
        word = self._mt_tp_words.get(self._mt_embed_path)
        if not self.cfg.tie_embeddings or word is None:
            return None
        head_split = self._mt_embed is not None
        if word == ("embedding_rowwise" if head_split else "replicate"):
            return None
        path, name = self._mt_embed_path, type(self).__name__
        head = "by vocabulary rows" if head_split else "not at all (no base_model_pp_plan names the embedding)"
        fix = f"{path}=embedding_rowwise" if head_split else f"without {path}"
        return (f"{name} ties {path} to {HEAD}, which meshtrain splits {head}, but the tensor-parallel plan "
                f"gives {path} = {word!r}; give [model] hf_tp_plan with {fix}, or use tp = 1")

    # ---- pipeline stages ----

    def pipeline_stage(self, layer_ids: list[int], *, first: bool, last: bool) -> nn.Module:
        """A copy holding only ``layer_ids`` (names unchanged: "model.layers.5..."), the
        embeddings if ``first``, the final norm and output layer if ``last``. A stage after
        the first feeds its hidden states in as ``inputs_embeds``, which only works when the
        architecture passes them to its first block untouched (checked here, on meta)."""
        refusal = self.layout_refusal(tp=1, pp=2)
        if refusal:
            raise LayoutError(refusal)
        stage = copy.deepcopy(self)
        layers = stage._layers()
        keep = {str(i) for i in layer_ids}
        layers._modules = OrderedDict((k, m) for k, m in layers._modules.items() if k in keep)
        base = getattr(stage, stage._mt_base)
        if not first:
            setattr(base, stage._mt_embed, None)
        if not last:
            setattr(base, stage._mt_norm, nn.Identity())
            setattr(stage, HEAD, None)
        if last and not first and self.cfg.tie_embeddings:
            # The tied copy on this stage starts as the embedding does: initialized by a
            # (meta) copy of the embedding module under its name. See init_weights.
            source = f"{self._mt_base}.{self._mt_embed}"
            stage._mt_tied_sources = {f"{HEAD}.weight": (source, copy.deepcopy(self.get_submodule(source)))}
            tied = self._head().weight  # its own copy now, frozen if the weight is (a LoRA run's base)
            stage._head().weight = nn.Parameter(torch.empty_like(tied), requires_grad=tied.requires_grad)
        stage._mt_first, stage._mt_last = first, last
        return stage

    # ---- initialization: the architecture's distribution, the same whatever the layout ----

    @torch.no_grad()
    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        """Materialize (if on meta) and initialize each module with transformers'
        ``_init_weights``, run on full-size tensors from a generator seeded by (seed,
        module name); each rank keeps its own blocks. Tied copies start as their source."""
        materialize(self, device)
        aliases = {alias for names in self.tied_weights() for alias in names[1:]}
        for name, module in self.named_modules():
            name = canonical_name(name + ".").rstrip(".")
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if f"{name}.{n}".lstrip(".") not in aliases]
            if own or any(True for _ in module.buffers(recurse=False)):
                self._init_module(module, name, own, seed)
        for alias, (source, shadow) in self._mt_tied_sources.items():
            param = self.get_parameter(alias)
            shadow = copy.deepcopy(shadow)
            shadow.weight = nn.Parameter(torch.empty(param.shape, device=_local(param).device))
            self._init_module(shadow, source, [("weight", shadow.weight)], seed, into={"weight": param})
        init_adapters_(self, seed)  # LoRA's own init (PEFT's), where [lora] added adapters

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute derived buffers (rotary frequencies) after weights were loaded."""
        for name, module in self.named_modules():
            has_params = any(True for _ in module.parameters(recurse=False))
            if not has_params and any(True for _ in module.buffers(recurse=False)):
                self._init_module(module, canonical_name(name + ".").rstrip("."), [], 0)

    def learned_positions(self) -> bool:
        """Whether positions are a weight (a table of max_seq_len rows) rather than computed."""
        embed = self.get_input_embeddings()
        return any(isinstance(m, nn.Embedding) and m is not embed and m.num_embeddings == self.cfg.max_seq_len
                   for m in self.modules())

    def _init_module(self, module: nn.Module, name: str, own: list, seed: int, into: dict | None = None) -> None:
        fulls, originals = {}, {}
        for pname, param in own:
            originals[pname] = param
            fulls[pname] = torch.empty(param.shape, dtype=torch.float32, device=_local(param).device)
            module._parameters[pname] = nn.Parameter(fulls[pname], requires_grad=False)
        device = next(iter(fulls.values())).device if fulls else torch.device("cpu")
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed(param_seed(seed, name))
            self._init_weights(module)
        for pname, param in originals.items():
            module._parameters[pname] = param
            copy_block_((into or {}).get(pname, param), fulls[pname], f"{name}.{pname}")


def _ends(base: nn.Module, pp_plan: dict, layers: str, embedding: str | None) -> tuple[str | None, str | None]:
    """(embedding, final norm): the children of the base model that base_model_pp_plan lists
    before and after the layers -- Llama's embed_tokens / layers / norm, GPT-NeoX's
    embed_in / emb_dropout / layers / final_layer_norm. Anything else listed must hold no
    weights (a dropout runs on every stage). (None, None) when they cannot be told apart:
    FSDP's root unit then holds the ends and a pipeline cannot be cut."""
    names = list(pp_plan)
    if layers not in names:
        return None, None
    before, after = names[:names.index(layers)], names[names.index(layers) + 1:]
    if embedding not in before or len(after) != 1:
        return None, None
    others = [getattr(base, n, None) for n in before if n != embedding]
    if any(not isinstance(m, nn.Module) or any(True for _ in m.parameters()) for m in others):
        return None, None
    return embedding, after[0]


def _holds(module: nn.Module, path: str) -> bool:
    """Whether ``module`` has a submodule at ``path`` (a pipeline stage drops its ends)."""
    try:
        return module.get_submodule(path) is not None
    except AttributeError:
        return False


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class _FirstBlockReached(Exception):
    pass


def _stop_at_first_block(hidden_states=None, *args, **kwargs):
    raise _FirstBlockReached(hidden_states)


def _embeddings_pass_through(model: HFModel) -> bool:
    """Whether the base model hands ``inputs_embeds`` to its first block untouched: run it
    once on CPU on a tiny input, with a stub that stops at the first block and no weights
    (the embedding and blocks left out; what runs before the first block is position and
    mask arithmetic). An architecture that scales its embeddings in forward would scale a
    later stage's incoming hidden states again."""
    base = getattr(model, model._mt_base)
    layers, embed = model._layers(), getattr(base, model._mt_embed)
    stub = nn.Module()
    stub.forward = _stop_at_first_block
    try:
        setattr(base, model._mt_layers, nn.ModuleList([stub]))
        setattr(base, model._mt_embed, None)
        probe_base = copy.deepcopy(base)
    finally:
        setattr(base, model._mt_layers, layers)
        setattr(base, model._mt_embed, embed)
    probe_base.to_empty(device="cpu")
    probe = torch.zeros(1, 2, model.cfg.dim)
    try:
        probe_base(inputs_embeds=probe)
        reached = None
    except _FirstBlockReached as stop:
        reached = stop.args[0]
    return reached is probe
