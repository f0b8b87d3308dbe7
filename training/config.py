"""Typed run configuration: dataclass defaults, TOML files, command-line overrides.

A run is one JobConfig. Its values come from, lowest precedence first: the defaults
below, a TOML file (which may `extends` another file), and `--section.key value` flags.
Everything is type-, range- and choice-checked before any process group exists, so a
typo fails in a second with a readable message instead of after model init on 64 GPUs.

Accepted choices and ranges sit in each field's metadata next to its default: one
generic validator enforces them, and help text (and docs) are generated from the same
data, so the three cannot drift apart.
"""

import dataclasses
import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

# The keys of models.llama.FLAVORS and models.gpt2.FLAVORS, repeated here so that reading
# a config never imports torch (a test keeps the lists equal).
LLAMA_FLAVORS = ("debug", "1B", "8B", "70B", "405B")
GPT2_FLAVORS = ("debug", "124M", "350M", "774M", "1.5B", "6.7B", "13B", "175B")
MODEL_FLAVORS = {"llama": LLAMA_FLAVORS, "gpt2": GPT2_FLAVORS}
DTYPES = ("float32", "bfloat16")
# The keys of parallel.pipeline.SCHEDULES (the same test keeps them equal).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                "ZBVZeroBubble", "DualPipeV")


class ConfigError(Exception):
    """A bad config; the message is the whole explanation shown to the user."""


def opt(default, help: str, **checks):
    """A config field. ``checks`` is data for the validator and the help text:
    choices; min/max (inclusive) and gt/lt (exclusive) bounds, which apply to each item
    of a list; also (values accepted outside the range, such as -1 = infer); aliases
    (spellings people try for this key, e.g. torchtitan's names, so the typo message can
    point at the right one). A list default is copied for every config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass
class JobSection:
    name: str = opt("debug", "run name, used in logs and output paths")
    output_dir: str = opt("outputs", "folder for checkpoints and TensorBoard logs")
    description: str = opt("", "free text, shown in TensorBoard")
    device: str = opt("auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    debug: bool = opt(False, "extra checks and verbose logging")


@dataclass
class ModelSection:
    name: str = opt("llama", "model family: llama (Llama 3) or gpt2 (GPT-2/GPT-3 shapes, tied "
                    "embeddings)", choices=tuple(MODEL_FLAVORS))
    flavor: str = opt("debug", "size preset of that family (debug is tiny, for tests)",
                      choices=tuple(dict.fromkeys(LLAMA_FLAVORS + GPT2_FLAVORS)))
    vocab_size: int = opt(0, "embedding rows; 0: take it from the tokenizer", min=0,
                          max=2**31)  # token ids are int32
    norm_eps: float = opt(1e-5, "epsilon of the norms (RMSNorm in Llama, LayerNorm in GPT-2)", gt=0,
                          lt=math.inf)
    n_layers: int = opt(0, "transformer blocks; 0: the flavor's (fewer: a flavor's blocks on fewer "
                        "GPUs, for benchmarks and smoke tests)", min=0, max=10_000)


@dataclass
class TrainingSection:
    steps: int = opt(20, "optimizer steps to run", min=1)
    global_batch_size: int = opt(8, "sequences per optimizer step, all data-parallel ranks together", min=1)
    local_batch_size: int = opt(0, "sequences per forward on one rank; 0: global/dp (no accumulation)", min=0)
    seq_len: int = opt(128, "tokens per sequence", min=2,  # one input and one label at least
                       max=2**31)  # larger ones overflow torch's sizes
    seed: int = opt(0, "seed for weight init and data order")
    max_norm: float = opt(1.0, "gradient clipping norm; 0 disables clipping", min=0)
    dataset: str = opt("stdlib", "corpus: stdlib (Python's own sources) or text (dataset_path)",
                       choices=("stdlib", "text"))
    dataset_path: str = opt("", "file or folder for the text dataset")
    tokenizer: str = opt("byte", "byte, or the path of a Hugging Face tokenizer.json")
    mixed_precision_param: str = opt("float32", "dtype of parameters in forward/backward", choices=DTYPES)
    mixed_precision_reduce: str = opt("float32", "dtype of the gradient reduction", choices=DTYPES)
    nonfinite: str = opt("stop", "a step whose loss or gradient norm is inf/NaN: stop (after "
                         "checkpointing the last good state) or skip it (no update)", choices=("stop", "skip"))
    max_skipped_steps: int = opt(3, "skip: stop anyway after this many skipped steps", min=0)


@dataclass
class OptimizerSection:
    name: str = opt("AdamW", "optimizer", choices=("AdamW",))
    lr: float = opt(3e-4, "peak learning rate", gt=0, lt=math.inf)
    beta1: float = opt(0.9, "AdamW beta1", min=0, lt=1)
    beta2: float = opt(0.95, "AdamW beta2", min=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0, lt=math.inf)
    weight_decay: float = opt(0.1, "decoupled weight decay (matrices and embeddings only)", min=0,
                              lt=math.inf)


@dataclass
class LRSchedulerSection:
    warmup_steps: int = opt(2, "steps of linear warmup to the peak lr", min=0)
    decay_type: str = opt("cosine", "shape of the decay after warmup",
                          choices=("cosine", "linear", "wsd", "constant"))
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak", min=0, max=1)
    decay_ratio: float = opt(0.2, "wsd: fraction of the steps spent decaying", min=0, max=1)


@dataclass
class ParallelismSection:
    dp_replicate: int = opt(1, "data-parallel replicas (HSDP outer dimension)", min=1,
                            aliases=("data_parallel_replicate_degree", "dp_replicate_degree"))
    dp_shard: int = opt(-1, "FSDP shard degree; -1: whatever the world size leaves", min=1, also=(-1,),
                        aliases=("data_parallel_shard_degree", "dp_shard_degree", "fsdp"))
    tp: int = opt(1, "tensor-parallel degree (keep it within a node)", min=1,
                  aliases=("tensor_parallel", "tensor_parallel_degree", "tp_degree"))
    pp: int = opt(1, "pipeline-parallel stages", min=1,
                  aliases=("pipeline_parallel", "pipeline_parallel_degree", "pp_degree"))
    pp_schedule: str = opt("1F1B", "pipeline schedule (torch.distributed.pipelining)", choices=PP_SCHEDULES,
                           aliases=("pipeline_parallel_schedule",))
    pp_microbatches: int = opt(0, "micro-batches the schedule cuts each local batch into; "
                               "0: one per pipeline stage", min=0,
                               aliases=("pipeline_parallel_microbatches", "microbatches"))
    pp_stages_per_rank: int = opt(0, "virtual stages per pp rank (looped / V schedules); "
                                  "0: 1 for GPipe/1F1B, else 2", min=0)
    pp_layers_per_stage: int = opt(0, "layers in each stage (the last takes the rest); "
                                   "0: split as evenly as possible", min=0,
                                   aliases=("pipeline_parallel_layers_per_stage",))
    pp_split_points: list[int] = opt([], "first layer of each stage after the first, e.g. [8, 16, 24]",
                                     min=1, aliases=("pipeline_parallel_split_points",))
    sharding_strategy: str = opt("auto", "what FSDP shards and when it reshards; auto: FULL_SHARD, "
                                 "SHARD_GRAD_OP under a pipeline, HYBRID_* with dp_replicate > 1",
                                 choices=("auto", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                          "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"))
    sequence_parallel: bool = opt(True, "shard norms/residuals over the sequence inside TP")
    loss_parallel: bool = opt(True, "cross-entropy on vocab-sharded logits inside TP")
    cpu_offload: bool = opt(False, "keep FSDP parameter shards and optimizer state on CPU")


@dataclass
class CheckpointSection:
    enable: bool = opt(False, "save checkpoints, and resume from the newest one at start")
    folder: str = opt("checkpoint", "checkpoint folder, inside the job's output folder")
    interval: int = opt(500, "save every this many steps (and at the last step)", min=1)
    keep_latest_k: int = opt(0, "checkpoints to keep; 0 keeps all", min=0)
    async_save: bool = opt(False, "write checkpoints in the background while training goes on",
                           aliases=("async_mode",))
    load_step: int = opt(0, "resume from this step's checkpoint; 0: the newest complete one", min=0)
    last_save_model_only: bool = opt(False, "the last step saves model weights only (export_dtype)",
                                     aliases=("last_save_model_weights_only",))
    export_dtype: str = opt("float32", "dtype of the model-only last save", choices=DTYPES)
    if_config_differs: str = opt("refuse", "the newest checkpoint was written with another config "
                                 "(model, data, optimizer...): refuse, or resume anyway",
                                 choices=("refuse", "resume"))
    initial_load_hf: str = opt("", "a Hugging Face Llama folder (config.json + *.safetensors) to "
                               "start from when there is no checkpoint to resume")


@dataclass
class MetricsSection:
    log_freq: int = opt(10, "log every this many steps", min=1)
    enable_tensorboard: bool = opt(True, "write TensorBoard event files")


@dataclass
class ActivationCheckpointSection:
    mode: str = opt("none", "recompute activations in backward: none, full (every block), "
                    "selective (every selective_every-th block) or op (every block, keeping "
                    "matmul, attention and collective outputs: only cheap ops are recomputed)",
                    choices=("none", "full", "selective", "op"))
    selective_every: int = opt(2, "selective: checkpoint one block in this many", min=1)


@dataclass
class CompileSection:
    enable: bool = opt(False, "torch.compile each transformer block")
    loss: bool = opt(False, "torch.compile the cross-entropy too (fuses the fp32 upcast of the "
                     "logits into the softmax instead of materializing it)")
    async_tp: bool = opt(False, "async tensor parallelism: compile overlaps each TP all-gather / "
                         "reduce-scatter with its matmul (needs CUDA, enable = true and tp > 1)")


@dataclass
class Float8Section:
    enable: bool = opt(False, "train the Linear layers (not the output layer) in float8 with "
                       "torchao (pip install torchao; CUDA with compute capability >= 8.9)")


@dataclass
class CommSection:
    init_timeout_seconds: float = opt(600.0, "collective timeout until the first step is done "
                                      "(start-up, compilation, shape inference)", gt=0,
                                      max=365 * 86400)  # a year; inf or ~1e14 overflow timedelta
    train_timeout_seconds: float = opt(300.0, "collective timeout after the first step: a rank "
                                       "that dies or stalls fails the others this fast", gt=0,
                                       max=365 * 86400, aliases=("timeout",))


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    compile: CompileSection = field(default_factory=CompileSection)
    float8: Float8Section = field(default_factory=Float8Section)
    comm: CommSection = field(default_factory=CommSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(JobConfig)}
CLI = "command line"  # the source name used in messages for --section.key overrides


# ---------------------------------------------------------------- values and messages

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list[int]: "a list of integers, like [8, 16] (on the command line: 8,16)"}


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
        return value in meta["choices"]
    if value in meta.get("also", ()):
        return True
    if isinstance(value, float) and math.isnan(value):
        return not any(k in meta for k in ("min", "max", "gt", "lt"))
    return not (("min" in meta and value < meta["min"]) or ("max" in meta and value > meta["max"])
                or ("gt" in meta and value <= meta["gt"]) or ("lt" in meta and value >= meta["lt"]))


def describe_accepted(meta) -> str:
    """The accepted values of a field, in words (for messages and help)."""
    if "choices" in meta:
        return ", ".join(_toml_value(c) for c in meta["choices"])
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
                guess = _closest(str(value), {c: c for c in meta["choices"]})
                hint = f" Did you mean {_toml_value(guess)}?" if guess is not None else ""
                raise ConfigError(f"{where} is not accepted.{hint} "
                                  f"Accepted values: {describe_accepted(meta)}.")
            raise ConfigError(f"{where} is out of range; accepted: {describe_accepted(meta)}.")

    m = cfg.model
    if m.flavor not in MODEL_FLAVORS[m.name]:
        where = _where("model", "flavor", m.flavor, sources.get(("model", "flavor")))
        raise ConfigError(f'{where} is not a {m.name} flavor ([model] name = "{m.name}"). '
                          f"Accepted values: {', '.join(MODEL_FLAVORS[m.name])}.")

    t = cfg.training
    if t.local_batch_size and t.global_batch_size % t.local_batch_size:
        where = _where("training", "local_batch_size", t.local_batch_size,
                       sources.get(("training", "local_batch_size")))
        raise ConfigError(f"{where} must divide global_batch_size = {t.global_batch_size}: every "
                          f"step runs whole micro-batches. Use a divisor of {t.global_batch_size}, "
                          f"or 0 for one micro-batch per rank.")


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


def format_help() -> str:
    """Usage plus every key with its default, accepted values and meaning."""
    lines = ["usage: train.py [--config NAME_OR_PATH] [--print-config] [--debug] [--section.key VALUE ...]",
             "       train.py --config NAME --dry-run [--world-size N] [--rank R] [--gpus-per-node G] [--gpu h100-80gb]",
             "                (trace one step of rank R at world size N on a fake process group: mesh,",
             "                 memory breakdown, communication; no GPU needed)", ""]
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
    world_size: int | None = None     # --dry-run: the world to plan for (default: launched)
    rank: int = 0                     # --dry-run: whose view to trace
    gpus_per_node: int = 8            # --dry-run: to say which node each rank lands on
    gpu: str = ""                     # --dry-run: compare the peak with this GPU's memory
    overrides: list[str] = field(default_factory=list)


_FLAGS = ("--config NAME_OR_PATH", "--print-config", "--debug", "--dry-run", "--world-size N", "--rank R",
          "--gpus-per-node G", "--gpu NAME")
_INT_FLAGS = {"--world-size": ("world_size", 1), "--rank": ("rank", 0), "--gpus-per-node": ("gpus_per_node", 1)}


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
        elif flag in ("--print-config", "--dry-run", "--debug"):
            if eq:
                raise ConfigError(f"{CLI}: {flag} takes no value")
            if flag == "--debug":  # same precedence as any other override, in argv order
                args.overrides.append("--job.debug=true")
            else:
                setattr(args, flag[2:].replace("-", "_"), True)
        elif flag.startswith("--") and "." not in flag:  # "-1" may be an override's value
            raise ConfigError(f"{CLI}: unknown flag {flag}. Accepted: {', '.join(_FLAGS)}, "
                              f"and --section.key=value overrides (see --help).")
        else:
            args.overrides.append(token)

    path = find_config(config) if config is not None else None
    args.config_path = str(path) if path is not None else None
    return load_config(path, args.overrides), args
