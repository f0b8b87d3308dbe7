"""A config setting's value and the words for it: converting what a TOML file or the
command line gave to the schema's type, and saying where a setting came from and what
is accepted instead, the start of every config message (training/config_checks.py,
training/config_loader.py).

    where_set("training", "steps", 0, "debug_2d.toml")   # 'debug_2d.toml: [training] steps = 0'
"""

import dataclasses
import difflib
import json
import math
from dataclasses import fields
from typing import Any

from meshtrain.training.config import SECTIONS, ConfigError, choices

CLI = "command line"  # the source name used in messages for --section.key overrides

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              list[int]: "a list of integers, like [8, 16] (on the command line: 8,16)",
              list[str]: 'a list of strings, like ["a", "b"] (on the command line: a,b)'}


def coerce(value, typ, from_cli: bool):
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


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # repr round-trips floats exactly; inf and nan are TOML too
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, str):  # JSON string escapes are all valid TOML basic-string escapes
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(v)  # only in messages about a wrong-typed value


def where_set(section: str, key: str, value, source: str | None) -> str:
    """How the user wrote this setting, prefixed by where: the start of every message."""
    if source == CLI:
        shown = toml_value(value) if isinstance(value, bool) else value
        return f"{CLI}: --{section}.{key}={shown}"
    prefix = f"{source}: " if source else ""
    return f"{prefix}[{section}] {key} = {toml_value(value)}"


def closest(name: str, candidates: dict[str, Any]):
    """The candidate value whose spelling is closest to ``name``, or None."""
    lowered = {str(k).lower(): v for k, v in candidates.items()}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def schema_field(section: str, key: str, source: str) -> dataclasses.Field:
    """The schema field for section.key, or a ConfigError saying what exists instead."""
    head = f"{CLI}: --{section}.{key}" if source == CLI else source
    if section not in SECTIONS:
        guess = closest(section, {s: s for s in SECTIONS})
        hint = f" Did you mean [{guess}]?" if guess else ""
        raise ConfigError(f"{head}: unknown section [{section}].{hint} "
                          f"Accepted sections: {', '.join(f'[{s}]' for s in SECTIONS)}.")
    by_name = {f.name: f for f in fields(SECTIONS[section])}
    if key not in by_name:
        spellings = {n: n for n in by_name}
        spellings.update({a: f.name for f in by_name.values() for a in f.metadata.get("aliases", ())})
        guess = closest(key, spellings)
        hint = f" Did you mean '{guess}'?" if guess else ""
        raise ConfigError(f"{head}: unknown key '{key}' in [{section}].{hint} "
                          f"Accepted keys of [{section}]: {', '.join(by_name)}.")
    return by_name[key]


def accepts(meta, value) -> bool:
    if isinstance(value, list):
        return all(accepts(meta, v) for v in value)
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
        return ", ".join(toml_value(c) for c in choices(meta))
    ops = (("gt", ">"), ("min", ">="), ("lt", "<"), ("max", "<="))
    text = " and ".join(f"{op} {meta[k]}" for k, op in ops if k in meta)
    return "".join([text or "any value", *(f", or {v}" for v in meta.get("also", ()))])


