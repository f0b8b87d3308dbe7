"""Reading a run config: defaults, TOML files (with `extends`), command-line overrides,
and the checks that turn a typo into a one-line message before any process group exists.

    cfg = load_config("debug_2d", ["--training.steps=50"])
    cfg, args = parse_args(sys.argv[1:])           # train.py's command line

The schema (sections, fields, accepted values) is training/config.py.
"""

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import urllib.parse
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from meshtrain.models import registry
from meshtrain.training.config import SECTIONS, ConfigError, JobConfig, choices, default_of
from meshtrain.training.trackers import missing_package, resolve_trackers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
CLI = "command line"  # the source name used in messages for --section.key overrides


# ---------------------------------------------------------------- values and messages

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list[int]: "a list of integers, like [8, 16] (on the command line: 8,16)",
               list[str]: 'a list of strings, like ["a", "b"] (on the command line: a,b)'}


def _coerce(value, typ, from_cli: bool):
    """``value`` as a ``typ``; ValueError when it is not one. Command-line values are
    strings to convert; TOML values must already have the type (an int is fine for a
    float; a bool is never an int, though Python thinks so)."""
    if typ == list[int]:
        if from_cli:
            return [int(v) for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if type(value) is not list or any(type(v) is not int for v in value):
            raise ValueError(value)
        return value
    if typ == list[str]:
        if from_cli:
            return [v.strip() for v in value.split(",") if v.strip()]
        if type(value) is not list or any(type(v) is not str for v in value):
            raise ValueError(value)
        return value
    if from_cli:
        if typ is bool:
            word = value.strip().lower()
            if word in _TRUE + _FALSE:
                return word in _TRUE
            raise ValueError(value)
        return typ(value)
    if typ is float and type(value) is int:
        return float(value)
    if type(value) is not typ:
        raise ValueError(value)
    return value


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # repr round-trips floats exactly; inf and nan are TOML too
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):  # JSON string escapes are all valid TOML basic-string escapes
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(v)  # only in messages about a wrong-typed value


def _where(section: str, key: str, value, source: str | None) -> str:
    """How the user wrote this setting, prefixed by where: the start of every message."""
    if source == CLI:
        shown = _toml_value(value) if isinstance(value, bool) else value
        return f"{CLI}: --{section}.{key}={shown}"
    prefix = f"{source}: " if source else ""
    return f"{prefix}[{section}] {key} = {_toml_value(value)}"


def _closest(name: str, candidates: dict[str, Any]):
    """The candidate value whose spelling is closest to ``name``, or None."""
    lowered = {str(k).lower(): v for k, v in candidates.items()}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def _field(section: str, key: str, source: str) -> dataclasses.Field:
    """The schema field for section.key, or a ConfigError saying what exists instead."""
    head = f"{CLI}: --{section}.{key}" if source == CLI else source
    if section not in SECTIONS:
        guess = _closest(section, {s: s for s in SECTIONS})
        hint = f" Did you mean [{guess}]?" if guess else ""
        raise ConfigError(f"{head}: unknown section [{section}].{hint} "
                          f"Accepted sections: {', '.join(f'[{s}]' for s in SECTIONS)}.")
    by_name = {f.name: f for f in fields(SECTIONS[section])}
    if key not in by_name:
        spellings = {n: n for n in by_name}
        spellings.update({a: f.name for f in by_name.values() for a in f.metadata.get("aliases", ())})
        guess = _closest(key, spellings)
        hint = f" Did you mean '{guess}'?" if guess else ""
        raise ConfigError(f"{head}: unknown key '{key}' in [{section}].{hint} "
                          f"Accepted keys of [{section}]: {', '.join(by_name)}.")
    return by_name[key]


def _accepts(meta, value) -> bool:
    if isinstance(value, list):
        return all(_accepts(meta, v) for v in value)
    if "choices" in meta:
        return value in choices(meta)
    if value in meta.get("also", ()):
        return True
    if isinstance(value, float) and math.isnan(value):
        return not any(k in meta for k in ("min", "max", "gt", "lt"))
    return not (("min" in meta and value < meta["min"]) or ("max" in meta and value > meta["max"])
                or ("gt" in meta and value <= meta["gt"]) or ("lt" in meta and value >= meta["lt"]))


def describe_accepted(meta) -> str:
    """The accepted values of a field, in words (for messages and help)."""
    if "choices" in meta:
        return ", ".join(_toml_value(c) for c in choices(meta))
    ops = (("gt", ">"), ("min", ">="), ("lt", "<"), ("max", "<="))
    text = " and ".join(f"{op} {meta[k]}" for k, op in ops if k in meta)
    return "".join([text or "any value", *(f", or {v}" for v in meta.get("also", ()))])


# ---------------------------------------------------------------- checking a config

def validate(cfg: JobConfig, sources: dict[tuple[str, str], str] | None = None) -> None:
    """Types, ranges and choices of every field, then the cross-field rules that need no
    process group (degrees against the world size are checked where the mesh is built).
    ``sources`` maps (section, key) to where the value came from, for the message."""
    sources = sources or {}
    for sf in fields(cfg):
        section = getattr(cfg, sf.name)
        for f in fields(section):
            value, meta = getattr(section, f.name), f.metadata
            where = _where(sf.name, f.name, value, sources.get((sf.name, f.name)))
            try:
                _coerce(value, f.type, from_cli=False)
            except ValueError:
                raise ConfigError(f"{where} must be {_TYPE_WORDS[f.type]}") from None
            if _accepts(meta, value):
                continue
            if "choices" in meta:
                guess = _closest(str(value), {c: c for c in choices(meta)})
                hint = f" Did you mean {_toml_value(guess)}?" if guess is not None else ""
                raise ConfigError(f"{where} is not accepted.{hint} "
                                  f"Accepted values: {describe_accepted(meta)}.")
            raise ConfigError(f"{where} is out of range; accepted: {describe_accepted(meta)}.")

    m = cfg.model
    _check_hf_model(m, sources)
    flavors = registry.get(m.name).flavors
    if flavors and m.flavor not in flavors:
        where = _where("model", "flavor", m.flavor, sources.get(("model", "flavor")))
        raise ConfigError(f'{where} is not a {m.name} flavor ([model] name = "{m.name}"). '
                          f"Accepted values: {', '.join(flavors)}.")

    _check_moe(cfg, sources)
    _check_moe_compile(cfg, sources)
    _check_optimizer(cfg, sources)

    t = cfg.training
    if t.chunked_loss and cfg.compile.loss:
        where = _where("training", "chunked_loss", True, sources.get(("training", "chunked_loss")))
        other = _where("compile", "loss", True, sources.get(("compile", "loss")))
        raise ConfigError(f"{where} with {other}: both keep the fp32 copy of the logits out of memory, in two "
                          "ways that do not combine; set one of them to false")
    if t.local_batch_size and t.global_batch_size % t.local_batch_size:
        where = _where("training", "local_batch_size", t.local_batch_size,
                       sources.get(("training", "local_batch_size")))
        raise ConfigError(f"{where} must divide global_batch_size = {t.global_batch_size}: every "
                          f"step runs whole micro-batches. Use a divisor of {t.global_batch_size}, "
                          f"or 0 for one micro-batch per rank.")
    for name in resolve_trackers(cfg.metrics.trackers, cfg.metrics.enable_tensorboard):
        fix = missing_package(name)
        if fix:
            where = _where("metrics", "trackers", cfg.metrics.trackers, sources.get(("metrics", "trackers")))
            raise ConfigError(f"{where} names {name}, whose package is not installed: {fix}, "
                              f"or leave {name} out of [metrics] trackers")
    p = cfg.profiling
    if p.enable and p.start_step > t.steps:
        where = _where("profiling", "start_step", p.start_step, sources.get(("profiling", "start_step")))
        raise ConfigError(f"{where} is after the last step ([training] steps = {t.steps}): nothing would be "
                          f"profiled. Use a start_step from 1 to {t.steps}")
    _check_export_hf(cfg, sources)
    _check_fault_tolerance(cfg, sources)
    lo = cfg.lora
    if lo.initial_load_adapter and not lo.enable:
        where = _where("lora", "initial_load_adapter", lo.initial_load_adapter,
                       sources.get(("lora", "initial_load_adapter")))
        raise ConfigError(f"{where} is read only with [lora] enable = true")
    v = cfg.validation
    check_validation(cfg, sources, needed_by=_where("validation", "enable", v.enable,
                                                    sources.get(("validation", "enable"))) if v.enable else "")


def check_validation(cfg: JobConfig, sources: dict | None = None, *, needed_by: str = "") -> None:
    """[validation]: where its data comes from, said one way. ``needed_by``: who evaluates
    (enable = true, or `meshtrain evaluate`), so there must be data; empty: nobody yet."""
    v, sources = cfg.validation, sources or {}
    where = lambda key: _where("validation", key, getattr(v, key), sources.get(("validation", key)))
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
    where = _where("checkpoint", "export_hf_interval", every, sources.get(("checkpoint", "export_hf_interval")))
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
    where = lambda key: _where("fault_tolerance", key, getattr(ft, key), sources.get(("fault_tolerance", key)))
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
    layout = lambda key: _where("parallelism", key, getattr(p, key), sources.get(("parallelism", key)))
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
        where = _where("optimizer", given[0], getattr(o, given[0]), sources.get(("optimizer", given[0])))
        raise ConfigError(f'{where} is a Muon setting, read only with [optimizer] name = "Muon" (name is '
                          f'"{o.name}"). Remove it or use name = "Muon"')
    if o.name != "Muon":
        return
    name = _where("optimizer", "name", o.name, sources.get(("optimizer", "name")))
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
        where = _where("moe", key, getattr(cfg.moe, key), sources.get(("moe", key)))
        raise ConfigError(f'{where} is for [model] name = "moe" (a mixture of experts); name is '
                          f'"{cfg.model.name}". Remove the [moe] settings or use name = "moe"')
    from meshtrain.models.moe.config import moe_problems

    flavor = registry.get("moe").flavors[cfg.model.flavor]
    shape = dataclasses.replace(flavor, n_layers=cfg.model.n_layers or flavor.n_layers)
    shape.__dict__.update(given)  # checked below, not by __post_init__: the message names the [moe] key
    for key, problem in moe_problems(shape):
        if key in given:
            where = _where("moe", key, getattr(cfg.moe, key), sources.get(("moe", key)))
        else:  # a [moe] setting against the flavor's own value (n_experts below the flavor's top_k)
            settings = ", ".join(f"{k} = {_toml_value(getattr(cfg.moe, k))}" for k in given)
            where = f'[moe] {settings} with [model] flavor = "{cfg.model.flavor}" (its {key} = {getattr(shape, key)})'
        raise ConfigError(f"{where}: {problem}")


def _check_moe_compile(cfg: JobConfig, sources) -> None:
    """A compiled mixture of experts runs its experts as torch._grouped_mm, which compiles
    in bf16 only (its meta function refuses other dtypes); the per-expert loop splits at
    data-dependent sizes, which a whole-block graph cannot hold."""
    if not (cfg.compile.enable and cfg.model.name == "moe") or cfg.training.mixed_precision_param == "bfloat16":
        return
    where = _where("compile", "enable", True, sources.get(("compile", "enable")))
    param = _where("training", "mixed_precision_param", cfg.training.mixed_precision_param,
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
            where = _where("model", hf_keys[0], getattr(m, hf_keys[0]), sources.get(("model", hf_keys[0])))
            raise ConfigError(f'{where} is for [model] name = "hf" (a Hugging Face model); name is "{m.name}"')
        return
    where = _where("model", "hf_config", m.hf_config, sources.get(("model", "hf_config")))
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
            where = _where("model", "hf_tp_plan", m.hf_tp_plan, sources.get(("model", "hf_tp_plan")))
            raise ConfigError(f'{where}: entry "{entry}" is not "module.pattern=style" '
                              '(e.g. "layers.*.mlp.up_proj=colwise")')


# ---------------------------------------------------------------- files

def _display(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def available_configs() -> list[str]:
    dirs = dict.fromkeys([CONFIGS_DIR, Path.cwd() / "configs"])
    return sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.toml")})


def find_config(name: str | Path) -> Path:
    """A config file by path, or by name (with or without .toml) in the repo's configs/
    folder, then in ./configs."""
    name = str(name)
    places = [Path(), CONFIGS_DIR, Path.cwd() / "configs"]
    tried = [d / n for d in places for n in (name, f"{name}.toml")]
    for path in tried:
        if os.path.isfile(path):  # False, not OSError, for a name too long for the filesystem
            return path
    looked = ", ".join(dict.fromkeys(_display(p) for p in tried))
    raise ConfigError(f"config '{name}' not found (looked for {looked}). "
                      f"Available configs: {', '.join(available_configs()) or 'none'}.")


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{_display(path)}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8; tomllib lets the decode error through
        raise ConfigError(f"{_display(path)}: not valid TOML: not UTF-8 text "
                          f"({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{_display(path)}: cannot read the file: {e.strerror}") from None


def _read_chain(path: Path, stack: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """(name, table) for ``path`` and every file it extends, the most basic first."""
    path = path.resolve()
    if path in stack:
        cycle = " -> ".join(_display(p) for p in (*stack, path))
        raise ConfigError(f"`extends` goes round in a circle: {cycle}")
    table = _read_toml(path)
    parent = table.pop("extends", None)
    if parent is None:
        return [(_display(path), table)]
    if not isinstance(parent, str):
        raise ConfigError(f"{_display(path)}: extends = {_toml_value(parent)} must be a string: "
                          f"a path relative to this file, or a config name")
    tried = [d / n for d in (path.parent, CONFIGS_DIR) for n in (parent, f"{parent}.toml")]
    found = next((p for p in tried if os.path.isfile(p)), None)
    if found is None:
        raise ConfigError(f"{_display(path)}: extends = {_toml_value(parent)}: no such file "
                          f"(looked for {', '.join(_display(p) for p in tried)})")
    return _read_chain(found, (*stack, path)) + [(_display(path), table)]


def _settings_from_file(table: dict, source: str):
    """(section, key, value) for every setting of one parsed file."""
    for section, body in table.items():
        if not isinstance(body, dict):
            owners = [s for s in SECTIONS if section in {f.name for f in fields(SECTIONS[s])}]
            hint = f" Did you mean to put it under [{owners[0]}]?" if owners else ""
            raise ConfigError(f"{source}: '{section} = {_toml_value(body)}' is outside any section; "
                              f"settings go under a [section] (the only top-level key is "
                              f"'extends').{hint}")
        if section not in SECTIONS:  # even an empty [sectoin] is a typo worth naming
            _field(section, "", source)
        for key, value in body.items():
            yield section, key, value


def _settings_from_cli(tokens: list[str]):
    """(section, key, string) for ``--section.key=value`` / ``--section.key value``; a bool
    key given without a value means true."""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        name, eq, value = token.removeprefix("--").partition("=")
        section, dot, key = name.partition(".")
        if not (token.startswith("--") and dot and section and key):
            raise ConfigError(f"{CLI}: unexpected argument '{token}'; overrides look like "
                              f"--section.key=value or --section.key value")
        if not eq:
            if i < len(tokens) and not tokens[i].startswith("--"):
                value = tokens[i]
                i += 1
            elif _field(section, key, CLI).type is bool:
                value = "true"
            else:
                raise ConfigError(f"{CLI}: --{name} needs a value")
        yield section, key, value


def _dataset_defaults(values: dict) -> None:
    """The defaults that follow the dataset, resolved here so a saved config (which
    states every key) reads back the same: document_masking is on for "sft" (packed
    records must not see each other) and off for the pretraining streams."""
    training = values.setdefault("training", {})
    dataset = training.get("dataset", SECTIONS["training"].dataset)
    training.setdefault("document_masking", dataset == "sft")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> JobConfig:
    """Defaults, then the file (and what it extends), then the command-line overrides
    (argv-style tokens), checked as a whole."""
    values: dict[str, dict[str, Any]] = {}
    sources: dict[tuple[str, str], str] = {}

    def put(section, key, raw, source):
        f = _field(section, key, source)
        try:
            value = _coerce(raw, f.type, from_cli=source == CLI)
        except ValueError:
            words = _TYPE_WORDS[f.type]
            if source == CLI and f.type is bool:
                words += " (or 1/0, yes/no)"
            raise ConfigError(f"{_where(section, key, raw, source)} must be {words}") from None
        values.setdefault(section, {})[key] = value  # later sources overwrite key by key
        sources[(section, key)] = source

    if path is not None:
        for source, table in _read_chain(find_config(path)):
            for section, key, raw in _settings_from_file(table, source):
                put(section, key, raw, source)
    for section, key, raw in _settings_from_cli(list(overrides)):
        put(section, key, raw, CLI)

    _dataset_defaults(values)
    cfg = JobConfig(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})
    validate(cfg, sources)
    return cfg


# ---------------------------------------------------------------- output

def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: JobConfig) -> str:
    """The whole config as a TOML document; load_config reads it back to an equal config."""
    lines = []
    for section, body in config_to_dict(cfg).items():
        lines += [f"[{section}]", *(f"{k} = {_toml_value(v)}" for k, v in body.items()), ""]
    return "\n".join(lines)


def format_help(prog: str = "train.py", launcher: str = "") -> str:
    """Usage plus every key with its default, accepted values and meaning."""
    pad = " " * len(prog)
    lines = [f"usage: {prog} {launcher}[--config NAME_OR_PATH] [--print-config] [--debug] [--section.key VALUE ...]",
             f"       {prog} --config NAME --dry-run [--world-size N] [--rank R] [--gpus-per-node G] [--gpu h100-80gb]",
             f"       {pad}  (trace one step of rank R at world size N on a fake process group: mesh,",
             f"       {pad}   memory breakdown, communication; no GPU needed)",
             f"       {prog} --config NAME --world-size N --check-collectives [--dry-run] [--jobs J]",
             f"       {pad}  (check that every process group's members issue the same collectives, and",
             f"       {pad}   every pipeline receive meets its send: no hang at launch; after the dry run's",
             f"       {pad}   report with --dry-run)", ""]
    for name, cls in SECTIONS.items():
        lines.append(f"[{name}]")
        for f in fields(cls):
            accepted = describe_accepted(f.metadata)
            accepted = "" if accepted == "any value" else f" ({accepted})"
            lines.append(f"  --{name}.{f.name}={_toml_value(default_of(f))}".ljust(50)
                         + f" {f.metadata['help']}{accepted}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line

@dataclass
class CliArgs:
    """What the command line asks for besides the config itself."""
    config_path: str | None = None  # the file found for --config
    print_config: bool = False
    dry_run: bool = False
    debug: bool = False               # show the traceback of a refused input too
    world_size: int | None = None     # --dry-run / --check-collectives: the world to plan for (default: launched)
    rank: int = 0                     # --dry-run: whose view to trace
    gpus_per_node: int = 8            # --dry-run / --check-collectives: which node each rank lands on
    gpu: str = ""                     # --dry-run: compare the peak with this GPU's memory
    check_collectives: bool = False   # trace representative ranks on a fake world, compare their collectives
    jobs: int | None = None           # --check-collectives: processes tracing at once (default: this machine's cores)
    overrides: list[str] = field(default_factory=list)


_FLAGS = ("--config NAME_OR_PATH", "--print-config", "--debug", "--dry-run", "--world-size N", "--rank R",
          "--gpus-per-node G", "--gpu NAME", "--check-collectives", "--jobs J")
_INT_FLAGS = {"--world-size": ("world_size", 1), "--rank": ("rank", 0), "--gpus-per-node": ("gpus_per_node", 1),
              "--jobs": ("jobs", 1)}


def parse_args(argv: list[str] | None = None) -> tuple[JobConfig, CliArgs]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, config = CliArgs(), None
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        flag, eq, value = token.partition("=")
        if flag in ("-h", "--help"):
            print(format_help())
            raise SystemExit(0)
        if flag in ("--config", "--gpu") or flag in _INT_FLAGS:
            if not eq:
                if i == len(argv):
                    raise ConfigError(f"{CLI}: {flag} needs a value")
                value, i = argv[i], i + 1
            if flag == "--config":
                config = value
                continue
            if flag == "--gpu":
                args.gpu = value
                continue
            name, least = _INT_FLAGS[flag]
            if not value.isdecimal() or int(value) < least:  # isdigit() is true for "²"
                raise ConfigError(f"{CLI}: {flag}={value} must be an integer >= {least}")
            setattr(args, name, int(value))
        elif flag in ("--print-config", "--dry-run", "--debug", "--check-collectives"):
            if eq:
                raise ConfigError(f"{CLI}: {flag} takes no value")
            setattr(args, flag[2:].replace("-", "_"), True)
        elif flag.startswith("--") and "." not in flag:  # "-1" may be an override's value
            raise ConfigError(f"{CLI}: unknown flag {flag}. Accepted: {', '.join(_FLAGS)}, "
                              f"and --section.key=value overrides (see --help).")
        else:
            args.overrides.append(token)

    path = find_config(config) if config is not None else None
    args.config_path = str(path) if path is not None else None
    return load_config(path, args.overrides), args
