"""The checks of a loaded config that need no process group: every field's type, range
and choices, then the rules between fields and sections, each failure one ConfigError
that names the setting, where it was set and what is accepted (degrees against the world
size are checked where the mesh is built: training/recipe.py).

    validate(cfg, sources)     # sources: (section, key) -> the file or "command line"
"""

import dataclasses
import importlib.util
import urllib.parse
from dataclasses import fields

from meshtrain.models import registry
from meshtrain.training.config import ConfigError, JobConfig, choices, default_of
from meshtrain.training.config_values import (TYPE_WORDS, accepts, closest, coerce, describe_accepted,
                                              toml_value, where_set)
from meshtrain.training.trackers import missing_package, resolve_trackers


def validate(cfg: JobConfig, sources: dict[tuple[str, str], str] | None = None) -> None:
    """Types, ranges and choices of every field, then the cross-field rules that need no
    process group (degrees against the world size are checked where the mesh is built).
    ``sources`` maps (section, key) to where the value came from, for the message."""
    sources = sources or {}
    for sf in fields(cfg):
        section = getattr(cfg, sf.name)
        for f in fields(section):
            value, meta = getattr(section, f.name), f.metadata
            where = where_set(sf.name, f.name, value, sources.get((sf.name, f.name)))
            try:
                coerce(value, f.type, from_cli=False)
            except ValueError:
                raise ConfigError(f"{where} must be {TYPE_WORDS[f.type]}") from None
            if accepts(meta, value):
                continue
            if "choices" in meta:
                guess = closest(str(value), {c: c for c in choices(meta)})
                hint = f" Did you mean {toml_value(guess)}?" if guess is not None else ""
                raise ConfigError(f"{where} is not accepted.{hint} "
                                  f"Accepted values: {describe_accepted(meta)}.")
            raise ConfigError(f"{where} is out of range; accepted: {describe_accepted(meta)}.")

    m = cfg.model
    _check_hf_model(m, sources)
    flavors = registry.get(m.name).flavors
    if flavors and m.flavor not in flavors:
        where = where_set("model", "flavor", m.flavor, sources.get(("model", "flavor")))
        raise ConfigError(f'{where} is not a {m.name} flavor ([model] name = "{m.name}"). '
                          f"Accepted values: {', '.join(flavors)}.")

    _check_moe(cfg, sources)
    _check_moe_compile(cfg, sources)
    _check_optimizer(cfg, sources)

    t = cfg.training
    if t.chunked_loss and cfg.compile.loss:
        where = where_set("training", "chunked_loss", True, sources.get(("training", "chunked_loss")))
        other = where_set("compile", "loss", True, sources.get(("compile", "loss")))
        raise ConfigError(f"{where} with {other}: both keep the fp32 copy of the logits out of memory, in two "
                          "ways that do not combine; set one of them to false")
    if t.local_batch_size and t.global_batch_size % t.local_batch_size:
        where = where_set("training", "local_batch_size", t.local_batch_size,
                       sources.get(("training", "local_batch_size")))
        raise ConfigError(f"{where} must divide global_batch_size = {t.global_batch_size}: every "
                          f"step runs whole micro-batches. Use a divisor of {t.global_batch_size}, "
                          f"or 0 for one micro-batch per rank.")
    for name in resolve_trackers(cfg.metrics.trackers, cfg.metrics.enable_tensorboard):
        fix = missing_package(name)
        if fix:
            where = where_set("metrics", "trackers", cfg.metrics.trackers, sources.get(("metrics", "trackers")))
            raise ConfigError(f"{where} names {name}, whose package is not installed: {fix}, "
                              f"or leave {name} out of [metrics] trackers")
    p = cfg.profiling
    if p.enable and p.start_step > t.steps:
        where = where_set("profiling", "start_step", p.start_step, sources.get(("profiling", "start_step")))
        raise ConfigError(f"{where} is after the last step ([training] steps = {t.steps}): nothing would be "
                          f"profiled. Use a start_step from 1 to {t.steps}")
    par = cfg.parallelism
    if par.pp > 1 and par.gradient_sync == "microbatch":
        where = where_set("parallelism", "gradient_sync", par.gradient_sync, sources.get(("parallelism", "gradient_sync")))
        raise ConfigError(f"{where} with [parallelism] pp = {par.pp}: a pipeline schedule reduces each stage's "
                          'gradients once a step, after its last micro-batch (torch\'s PipelineStage); use "step" '
                          'or "auto", or pp = 1')
    _check_export_hf(cfg, sources)
    _check_fault_tolerance(cfg, sources)
    lo = cfg.lora
    if lo.initial_load_adapter and not lo.enable:
        where = where_set("lora", "initial_load_adapter", lo.initial_load_adapter,
                       sources.get(("lora", "initial_load_adapter")))
        raise ConfigError(f"{where} is read only with [lora] enable = true")
    v = cfg.validation
    check_validation(cfg, sources, needed_by=where_set("validation", "enable", v.enable,
                                                    sources.get(("validation", "enable"))) if v.enable else "")


def check_validation(cfg: JobConfig, sources: dict | None = None, *, needed_by: str = "") -> None:
    """[validation]: where its data comes from, said one way. ``needed_by``: who evaluates
    (enable = true, or `meshtrain evaluate`), so there must be data; empty: nobody yet."""
    v, sources = cfg.validation, sources or {}
    where = lambda key: where_set("validation", key, getattr(v, key), sources.get(("validation", key)))
    if v.split and v.dataset:
        raise ConfigError(f'{where("split")} holds out part of the training data, but [validation] '
                          f'dataset = "{v.dataset}" is a corpus of its own: use one or the other '
                          f"(split = 0 with a dataset)")
    if v.dataset_path and v.dataset in ("", "stdlib"):
        raise ConfigError(f'{where("dataset_path")} is read only with [validation] dataset = "text", '
                          f'"tokens" or "sft" (dataset is "{v.dataset}")')
    if v.dataset in ("text", "tokens", "sft") and not v.dataset_path:
        raise ConfigError(f'{where("dataset")} needs [validation] dataset_path = ' + {
            "text": "a file or folder of text",
            "tokens": "a folder prepared by `meshtrain prepare-data`",
            "sft": "a .jsonl/.parquet file, a folder of them, or a folder prepared by "
                   "`meshtrain prepare-data --kind sft`"}[v.dataset])
    if needed_by and not (v.dataset or v.split):
        raise ConfigError(f"{needed_by}, but [validation] has no data: set split (e.g. 0.05: the last 5% of the training data "
                          'is held out; with dataset = "sft", 5% of its records) or dataset (stdlib, text, tokens or '
                          "sft, with dataset_path)")


def _check_export_hf(cfg: JobConfig, sources) -> None:
    """[checkpoint] export_hf_interval: a family with a Hugging Face writer, the whole model
    on rank 0 (no pipeline), safetensors installed -- now, not at the first export."""
    every = cfg.checkpoint.export_hf_interval
    if not every:
        return
    where = where_set("checkpoint", "export_hf_interval", every, sources.get(("checkpoint", "export_hf_interval")))
    name = cfg.model.name
    if not registry.get(name).hf:
        raise ConfigError(f'{where}: [model] name = "{name}" has no Hugging Face converter (models/registry.py); '
                          f"the families that have one are {', '.join(f for f, fam in registry.FAMILIES.items() if fam.hf)}. "
                          "Use export_hf_interval = 0 (meshtrain export --format torch turns a checkpoint into one "
                          "torch file)")
    if cfg.parallelism.pp > 1:
        raise ConfigError(f"{where}: export during training gathers the whole model on rank 0, which a pipeline "
                          f"([parallelism] pp = {cfg.parallelism.pp}) spreads over its stages. Use "
                          "export_hf_interval = 0 and export the checkpoints afterwards: meshtrain export "
                          "STEP_DIR OUT --format hf")
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f'{where} writes safetensors, which is not installed: pip install "meshtrain[hf]" '
                          "(or pip install safetensors)")


def _check_fault_tolerance(cfg: JobConfig, sources) -> None:
    """[fault_tolerance]: a replica id among the groups, a lighthouse address torchft can
    dial, a layout whose replicas are the groups (FSDP inside each), then torchft installed.
    Whether the lighthouse answers is asked at start-up (training/recipe.py)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    where = lambda key: where_set("fault_tolerance", key, getattr(ft, key), sources.get(("fault_tolerance", key)))
    if ft.replica_id >= ft.group_size:
        raise ConfigError(f"{where('replica_id')} must be below [fault_tolerance] group_size = {ft.group_size} "
                          f"(the groups are numbered 0 .. {ft.group_size - 1})")
    url = urllib.parse.urlsplit(ft.lighthouse)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme not in ("http", "https") or not url.hostname or port is None:
        raise ConfigError(f"{where('lighthouse')} is not an address torchft can dial: use http://HOST:PORT "
                          "(torchft_lighthouse listens on port 29510 unless told --bind)")
    p = cfg.parallelism
    refusals = [("pp", p.pp > 1, "a replica group is FSDP (and TP) inside, not a pipeline: its stages' "
                 "updates would each need the quorum's commit; use pp = 1"),
                ("dp_replicate", p.dp_replicate > 1, "the replica groups are the replicas: use dp_replicate = 1 "
                 "and more groups"),
                ("ep", p.ep > 1, "experts split over ranks are reduced by their own FSDP groups, which the "
                 "replica groups do not average")]
    layout = lambda key: where_set("parallelism", key, getattr(p, key), sources.get(("parallelism", key)))
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(f"{where('enable')} with {layout(key)}: {why}")
    if p.sharding_strategy not in ("auto", "FULL_SHARD", "SHARD_GRAD_OP"):
        raise ConfigError(f"{where('enable')} with {layout('sharding_strategy')}: each replica group shards with "
                          'FSDP; use "FULL_SHARD", "SHARD_GRAD_OP" or "auto"')
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f'{where("enable")} needs torchft, which is not installed: pip install "meshtrain[ft]" '
                          "(or pip install torchft)")


def _check_optimizer(cfg: JobConfig, sources) -> None:
    """[optimizer]: Muon's keys set (to other than their defaults) only with name = "Muon",
    which needs each whole matrix gathered by collectives on the device."""
    o = cfg.optimizer
    defaults = {f.name: default_of(f) for f in fields(o)}
    given = [k for k in o.MUON_KEYS if ("optimizer", k) in sources and getattr(o, k) != defaults[k]]
    if o.name != "Muon" and given:
        where = where_set("optimizer", given[0], getattr(o, given[0]), sources.get(("optimizer", given[0])))
        raise ConfigError(f'{where} is a Muon setting, read only with [optimizer] name = "Muon" (name is '
                          f'"{o.name}"). Remove it or use name = "Muon"')
    if o.name != "Muon":
        return
    name = where_set("optimizer", "name", o.name, sources.get(("optimizer", "name")))
    if cfg.lora.enable:
        raise ConfigError(f"{name} with [lora] enable = true: Muon orthogonalises whole hidden matrices, and "
                          'LoRA trains low-rank adapters instead; use name = "AdamW" for LoRA')
    if cfg.parallelism.cpu_offload:
        raise ConfigError(f"{name} with [parallelism] cpu_offload = true: Muon gathers each hidden matrix with "
                          'collectives on the device, where offloaded shards are not; use name = "AdamW" or '
                          "cpu_offload = false")


def _check_moe(cfg: JobConfig, sources) -> None:
    """[moe]: only for [model] name = "moe", and a mixture that can work (top_k at most
    n_experts, ...), judged on the flavor with these settings applied (torch-free)."""
    given = cfg.moe.overrides()
    if not given:
        return
    key = next(iter(given))
    if cfg.model.name != "moe":
        where = where_set("moe", key, getattr(cfg.moe, key), sources.get(("moe", key)))
        raise ConfigError(f'{where} is for [model] name = "moe" (a mixture of experts); name is '
                          f'"{cfg.model.name}". Remove the [moe] settings or use name = "moe"')
    from meshtrain.models.moe.config import moe_problems

    flavor = registry.get("moe").flavors[cfg.model.flavor]
    shape = dataclasses.replace(flavor, n_layers=cfg.model.n_layers or flavor.n_layers)
    shape.__dict__.update(given)  # checked below, not by __post_init__: the message names the [moe] key
    for key, problem in moe_problems(shape):
        if key in given:
            where = where_set("moe", key, getattr(cfg.moe, key), sources.get(("moe", key)))
        else:  # a [moe] setting against the flavor's own value (n_experts below the flavor's top_k)
            settings = ", ".join(f"{k} = {toml_value(getattr(cfg.moe, k))}" for k in given)
            where = f'[moe] {settings} with [model] flavor = "{cfg.model.flavor}" (its {key} = {getattr(shape, key)})'
        raise ConfigError(f"{where}: {problem}")


def _check_moe_compile(cfg: JobConfig, sources) -> None:
    """A compiled mixture of experts runs its experts as torch._grouped_mm, which compiles
    in bf16 only (its meta function refuses other dtypes); the per-expert loop splits at
    data-dependent sizes, which a whole-block graph cannot hold."""
    if not (cfg.compile.enable and cfg.model.name == "moe") or cfg.training.mixed_precision_param == "bfloat16":
        return
    where = where_set("compile", "enable", True, sources.get(("compile", "enable")))
    param = where_set("training", "mixed_precision_param", cfg.training.mixed_precision_param,
                   sources.get(("training", "mixed_precision_param")))
    raise ConfigError(f'{where} with [model] name = "moe" and {param}: compiled experts run as '
                      f'torch._grouped_mm, which compiles in bfloat16 only; set mixed_precision_param = '
                      f'"bfloat16" or compile off')


def _check_hf_model(m, sources) -> None:
    """[model] name = "hf" and its keys: the config.json is read here (torch-free), the
    model class is found when the model is built (that needs transformers)."""
    hf_keys = [k for k in ("hf_config", "hf_block_classes", "hf_tp_plan") if getattr(m, k)]
    if m.name != "hf":
        if hf_keys:
            where = where_set("model", hf_keys[0], getattr(m, hf_keys[0]), sources.get(("model", hf_keys[0])))
            raise ConfigError(f'{where} is for [model] name = "hf" (a Hugging Face model); name is "{m.name}"')
        return
    where = where_set("model", "hf_config", m.hf_config, sources.get(("model", "hf_config")))
    if not m.hf_config:
        raise ConfigError(f'{where}: [model] name = "hf" needs hf_config = a Hugging Face config.json '
                          "or the folder holding it")
    from meshtrain.models.hf.config import read_hf_config

    try:
        read_hf_config(m.hf_config)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError('[model] name = "hf" builds the model with transformers, which is not installed: '
                          'pip install "meshtrain[hf]" (or pip install transformers)')
    for entry in m.hf_tp_plan:
        key, sep, style = entry.partition("=")
        if not (sep and key.strip() and style.strip()):
            where = where_set("model", "hf_tp_plan", m.hf_tp_plan, sources.get(("model", "hf_tp_plan")))
            raise ConfigError(f'{where}: entry "{entry}" is not "module.pattern=style" '
                              '(e.g. "layers.*.mlp.up_proj=colwise")')


