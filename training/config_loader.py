"""Reading a run config: defaults, TOML files (with `extends`), command-line overrides,
checked (training/config_checks.py) so that a typo is a one-line message before any
process group exists.

    cfg = load_config("debug_2d", ["--training.steps=50"])
    cfg, args = parse_args(sys.argv[1:])           # train.py's command line

The schema (sections, fields, accepted values) is training/config.py; the words of every
message, training/config_values.py.
"""

import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from meshtrain.training.config import SECTIONS, ConfigError, JobConfig, default_of
from meshtrain.training.config_checks import validate
from meshtrain.training.config_values import (CLI, TYPE_WORDS, coerce, describe_accepted, schema_field,
                                              toml_value, where_set)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


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
        raise ConfigError(f"{_display(path)}: extends = {toml_value(parent)} must be a string: "
                          f"a path relative to this file, or a config name")
    tried = [d / n for d in (path.parent, CONFIGS_DIR) for n in (parent, f"{parent}.toml")]
    found = next((p for p in tried if os.path.isfile(p)), None)
    if found is None:
        raise ConfigError(f"{_display(path)}: extends = {toml_value(parent)}: no such file "
                          f"(looked for {', '.join(_display(p) for p in tried)})")
    return _read_chain(found, (*stack, path)) + [(_display(path), table)]


def _settings_from_file(table: dict, source: str):
    """(section, key, value) for every setting of one parsed file."""
    for section, body in table.items():
        if not isinstance(body, dict):
            owners = [s for s in SECTIONS if section in {f.name for f in fields(SECTIONS[s])}]
            hint = f" Did you mean to put it under [{owners[0]}]?" if owners else ""
            raise ConfigError(f"{source}: '{section} = {toml_value(body)}' is outside any section; "
                              f"settings go under a [section] (the only top-level key is "
                              f"'extends').{hint}")
        if section not in SECTIONS:  # even an empty [sectoin] is a typo worth naming
            schema_field(section, "", source)
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
            elif schema_field(section, key, CLI).type is bool:
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
        f = schema_field(section, key, source)
        try:
            value = coerce(raw, f.type, from_cli=source == CLI)
        except ValueError:
            words = TYPE_WORDS[f.type]
            if source == CLI and f.type is bool:
                words += " (or 1/0, yes/no)"
            raise ConfigError(f"{where_set(section, key, raw, source)} must be {words}") from None
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
        lines += [f"[{section}]", *(f"{k} = {toml_value(v)}" for k, v in body.items()), ""]
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
            lines.append(f"  --{name}.{f.name}={toml_value(default_of(f))}".ljust(50)
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
