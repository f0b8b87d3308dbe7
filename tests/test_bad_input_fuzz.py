"""Property-based bad-input tests: any broken config or command line ends `train.run`
fast and cleanly.

The contract checked for every generated case (`assert_clean_failure`):

* exit code 2 (returned by `train.run`; a `SystemExit` would count with its own code);
* stderr is one paragraph starting `meshtrain: error:` that names what is wrong (the
  key, the file, the value: each test says which substrings it expects);
* no Python traceback (only `--debug` shows one: `test_debug_shows_the_traceback`);
* within a few seconds;
* before any process group exists and before any weights are allocated: every run here
  goes through `invoke`, which replaces `torch.distributed.init_process_group`,
  `init_device_mesh` and `Llama.init_weights` by a tripwire. A bad config that got that
  far is a test failure (as is exit 0 or an exception escaping `run`), never a pass.

Everything runs in this process (no torchrun, no subprocess); hypothesis example counts
are bounded (about 1600 cases, 15-40 s on 2 cores). A good config with random valid
overrides goes through the same harness (`test_good_configs_...`) and must *reach* the
tripwire, so the checks are shown not to reject everything; and any well-typed value of
any field, however silly, must either reach it or be refused cleanly
(`test_any_value_of_any_field_...`), whatever ranges the schema declares. The crashes
this fuzzing found are pinned as plain examples in `test_cases_the_fuzzing_found`.

Not covered here: a checkpoint of another model is refused only after the process group
exists (DCP needs one), so `test_checkpoint_of_another_model_...` is a plain test that
does create a one-process gloo group, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import stat
import string
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import meshtrain.parallel.mesh as parallel_mesh  # noqa: E402
from meshtrain import train  # noqa: E402
from meshtrain.models.llama import Llama  # noqa: E402
from meshtrain.training.config import PP_SCHEDULES, SECTIONS, choices  # noqa: E402
from meshtrain.training.config_loader import CONFIGS_DIR, available_configs, tomllib  # noqa: E402
from meshtrain.training.config_values import describe_accepted  # noqa: E402
from tests.in_process import ENV_KEYS  # noqa: E402

# A bad config must be refused within this many seconds (CI shares 2 cores; a refusal
# takes ~10 ms, the debug model on meta included).
SECONDS = 5.0
TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              list[int]: "a list of integers", list[str]: "a list of strings"}
FIELDS = [(section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
RANGED = [(s, f) for s, f in FIELDS if {"min", "max", "gt", "lt"} & set(f.metadata)]
CHOICE = [(s, f) for s, f in FIELDS if "choices" in f.metadata]
# The debug flavor and the byte tokenizer: what tp must divide, and the layers pp cuts.
DEBUG_SIZES = {"heads": 8, "kv heads": 4, "FFN width": 256}
TOKENIZER_VOCAB, PADDED_VOCAB, DEBUG_LAYERS = 258, 320, 4
ONE_STAGE, V_SHAPED = ("GPipe", "1F1B"), ("ZBVZeroBubble", "DualPipeV")
EXAMPLES = {}  # family -> examples run, printed by the last test
PER_FIELD = 4  # hypothesis examples for each field in the per-field families


def ids(fields_):
    return [f"{section}.{f.name}" for section, f in fields_]


def fuzz(n: int):
    """Bounded hypothesis settings: no deadline (CI is loaded), no example database on disk."""
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---------------------------------------------------------------- the harness

class ReachedTraining(BaseException):
    """Raised by the tripwires: the run got past every check. BaseException, so that no
    `except ValueError` on the way can turn it into a clean-looking exit."""


def _tripwire(what):
    def trip(*args, **kwargs):
        raise ReachedTraining(what)
    return trip


@dataclasses.dataclass
class Outcome:
    argv: list
    code: int | None = None
    stdout: str = ""
    stderr: str = ""
    crash: str | None = None      # an exception that escaped train.run, with its traceback
    reached: str | None = None    # which tripwire fired
    seconds: float = 0.0


def invoke(argv: list[str], world_size: int | None = None) -> Outcome:
    """train.run(argv) in this process, as rank 0 of `world_size` launched ranks."""
    import traceback

    out, err = io.StringIO(), io.StringIO()
    result = Outcome(argv=list(argv))
    with pytest.MonkeyPatch.context() as mp:
        for key in ENV_KEYS:  # restored afterwards, whatever the run set (setenv records a key
            mp.setenv(key, "")     # that was absent, so it is removed again; delenv alone would not)
            mp.delenv(key)
        if world_size is not None:
            mp.setenv("WORLD_SIZE", str(world_size))
            mp.setenv("RANK", "0")
            mp.setenv("LOCAL_RANK", "0")
        mp.setattr(dist, "init_process_group", _tripwire("init_process_group"))
        mp.setattr(parallel_mesh, "init_device_mesh", _tripwire("init_device_mesh"))
        mp.setattr(Llama, "init_weights", _tripwire("Llama.init_weights"))
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                result.code = train.run(list(argv))
        except ReachedTraining as e:
            result.reached = str(e)
        except SystemExit as e:
            result.code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - a crash is what we are looking for
            result.crash = traceback.format_exc()
        result.seconds = time.perf_counter() - start
    result.stdout, result.stderr = out.getvalue(), err.getvalue()
    return result


def assert_clean_failure(r: Outcome, *needles: str) -> str:
    """The contract for bad input; returns the message."""
    context = f"\nargv: {r.argv}\nstderr: {r.stderr!r}"
    assert r.crash is None, f"crashed instead of a clean error:{context}\n{r.crash}"
    assert r.reached is None, f"bad input was accepted: got as far as {r.reached}{context}"
    assert r.code == 2, f"exit code {r.code}, expected 2{context}"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, context
    assert not dist.is_initialized(), "a process group was created" + context
    assert r.seconds < SECONDS, f"took {r.seconds:.1f} s" + context
    msg = r.stderr.strip()
    assert msg.startswith("meshtrain: error: "), context
    assert msg.count("meshtrain: error:") == 1 and "\n\n" not in msg, "not one paragraph" + context
    for needle in needles:
        assert needle in msg, f"message does not mention {needle!r}{context}"
    return msg


def count(name: str):
    EXAMPLES[name] = EXAMPLES.get(name, 0) + 1


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def fresh_dir(workdir: Path) -> Path:
    """A new folder per hypothesis example (function-scoped tmp_path is shared by them)."""
    return Path(tempfile.mkdtemp(dir=workdir))


# ---------------------------------------------------------------- TOML and CLI values

def toml_literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(x)}" for k, x in v.items()) + "}"
    return v.isoformat()  # datetime.date


def toml_setting(section: str, key: str, value) -> str:
    text = f"[{section}]\n{key} = {toml_literal(value)}\n"
    parsed = tomllib.loads(text)[section][key]  # the file says what we meant
    assert type(parsed) is type(value) and toml_literal(parsed) == toml_literal(value), text
    return text


def cli_tokens(section: str, key: str, raw: str, separate: bool) -> list[str]:
    """`--section.key=raw`, or `--section.key raw` where parse_args cannot mistake raw
    for a flag of its own (it starts with "--", or is -h)."""
    if separate and not raw.startswith("--") and raw.partition("=")[0] != "-h":
        return [f"--{section}.{key}", raw]
    return [f"--{section}.{key}={raw}"]


def cli_number(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return repr(v) if isinstance(v, float) else str(v)


TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,14}", fullmatch=True)
TOML_SCALARS = {
    "str": TEXT,
    "int": st.integers(-2**63, 2**63 - 1),  # TOML integers are 64-bit
    "float": st.floats(),
    "bool": st.booleans(),
    "date": st.dates(),
}
TOML_LIST = st.lists(st.one_of(*TOML_SCALARS.values()), max_size=4)
TOML_TABLE = st.dictionaries(IDENT, st.one_of(*TOML_SCALARS.values()), max_size=3)


def wrong_toml_value(typ):
    """A TOML value of another type than `typ` (an int is a fine float, so not for one)."""
    kinds = dict(TOML_SCALARS, table=TOML_TABLE)
    allowed = {int: ("int",), float: ("int", "float"), bool: ("bool",), str: ("str",),
               list[int]: (), list[str]: ()}[typ]
    options = [s for name, s in kinds.items() if name not in allowed]
    if typ == list[int]:  # a list, but with something other than an integer in it
        options.append(st.lists(st.one_of(TOML_SCALARS["int"], TOML_SCALARS["str"], TOML_SCALARS["float"],
                                          TOML_SCALARS["bool"]), min_size=1, max_size=4)
                       .filter(lambda xs: any(type(x) is not int for x in xs)))
    elif typ == list[str]:  # a list, but with something other than a string in it
        options.append(st.lists(st.one_of(TOML_SCALARS["int"], TOML_SCALARS["str"], TOML_SCALARS["float"],
                                          TOML_SCALARS["bool"]), min_size=1, max_size=4)
                       .filter(lambda xs: any(type(x) is not str for x in xs)))
    else:
        options.append(TOML_LIST)
    return st.one_of(*options)


def _parses(fn, s: str) -> bool:
    try:
        fn(s)
        return True
    except (ValueError, OverflowError):
        return False


def _cli_list(s: str):
    return [int(v) for v in s.replace("[", "").replace("]", "").split(",") if v.strip()]


BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")
NOT_NUMBERS = st.one_of(TEXT, st.sampled_from(["1.5", "1e3", "0x10", "true", "[1, 2]", "{a=1}", "3 4", "",
                                               "1979-05-27", "ten", "--", "1,2"]))


def wrong_cli_value(typ):
    """A command-line string that does not convert to `typ` (none exists for str)."""
    if typ is int:
        return NOT_NUMBERS.filter(lambda s: not _parses(int, s))
    if typ is float:
        return NOT_NUMBERS.filter(lambda s: not _parses(float, s))
    if typ is bool:
        return st.one_of(TEXT, st.sampled_from(["2", "on", "off", "y", "n", "truee", "[true]"])).filter(
            lambda s: s.strip().lower() not in BOOL_WORDS)
    return st.one_of(TEXT, st.sampled_from(["1,x", "[1, 2.5]", "a", "1;2"])).filter(
        lambda s: not _parses(_cli_list, s))


# ---------------------------------------------------------------- 1. wrong types

@pytest.mark.parametrize("section,f", FIELDS, ids=ids(FIELDS))
@fuzz(PER_FIELD)
@given(data=st.data(), other=st.sampled_from(["", "debug_2d"]))
def test_wrong_type_in_a_file_names_file_key_and_type(workdir, section, f, data, other):
    value = data.draw(wrong_toml_value(f.type), label=f"{section}.{f.name}")
    path = fresh_dir(workdir) / "wrong_type.toml"
    path.write_text((f'extends = "{other}"\n' if other else "") + toml_setting(section, f.name, value))
    r = invoke(["--config", str(path)])
    assert_clean_failure(r, "wrong_type.toml", f"[{section}] {f.name} = ", f"must be {TYPE_WORDS[f.type]}")
    count("1 wrong type, file")


# On the command line any text is a str, and a list of them.
NON_STR = [(s, f) for s, f in FIELDS if f.type not in (str, list[str])]


@pytest.mark.parametrize("section,f", NON_STR, ids=ids(NON_STR))
@fuzz(PER_FIELD)
@given(data=st.data(), separate=st.booleans())
def test_wrong_type_on_the_command_line_names_key_and_type(section, f, data, separate):
    raw = data.draw(wrong_cli_value(f.type), label=f"{section}.{f.name}")
    r = invoke(["--config", "debug_2d", *cli_tokens(section, f.name, raw, separate)])
    assert_clean_failure(r, f"command line: --{section}.{f.name}={raw}", f"must be {TYPE_WORDS[f.type]}")
    count("1 wrong type, command line")


# ---------------------------------------------------------------- 2. unknown keys, sections, flags

@st.composite
def typo(draw, word: str):
    """`word` with one character dropped, doubled, swapped with the next, or replaced."""
    i = draw(st.integers(0, len(word) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "replace"]))
    if how == "drop":
        return word[:i] + word[i + 1:]
    if how == "double":
        return word[:i] + word[i] * 2 + word[i + 1:]
    if how == "swap" and i + 1 < len(word):
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    return word[:i] + draw(st.sampled_from(string.ascii_lowercase + "_")) + word[i + 1:]


@st.composite
def unknown_key(draw):
    """(section, key, is_typo) with key no field of section."""
    section = draw(st.sampled_from(list(SECTIONS)))
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    is_typo = draw(st.booleans())
    key = draw(typo(draw(st.sampled_from(names))) if is_typo else IDENT)
    assume(key and key not in names and re.fullmatch(r"[A-Za-z0-9_]+", key))
    return section, key, is_typo


def _check_unknown_key(msg: str, section: str, key: str, is_typo: bool):
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if is_typo and len(key) >= 3:  # one edit away from a real key: it is suggested
        guess = re.search(r"Did you mean '([^']+)'\?", msg)
        assert guess and guess.group(1) in names, msg


@fuzz(60)
@given(case=unknown_key(), value=st.one_of(*TOML_SCALARS.values()), cli=st.booleans())
def test_unknown_key_names_it_and_lists_the_accepted_keys(workdir, case, value, cli):
    section, key, is_typo = case
    names = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
    if cli:
        r = invoke(["--config", "debug_2d", f"--{section}.{key}=1"])
        needles = [f"command line: --{section}.{key}"]
    else:
        path = fresh_dir(workdir) / "unknown_key.toml"
        path.write_text(f"[{section}]\n{key} = {toml_literal(value)}\n")
        r = invoke(["--config", str(path)])
        needles = ["unknown_key.toml"]
    msg = assert_clean_failure(r, *needles, f"unknown key '{key}' in [{section}]",
                               f"Accepted keys of [{section}]: {names}.")
    _check_unknown_key(msg, section, key, is_typo)
    count("2 unknown key")


@st.composite
def unknown_section(draw):
    is_typo = draw(st.booleans())
    name = draw(typo(draw(st.sampled_from(list(SECTIONS)))) if is_typo else IDENT)
    assume(name and name not in SECTIONS and re.fullmatch(r"[A-Za-z0-9_]+", name))
    return name, is_typo


@fuzz(40)
@given(case=unknown_section(), key=IDENT, cli=st.booleans())
def test_unknown_section_names_it_and_lists_the_accepted_sections(workdir, case, key, cli):
    name, is_typo = case
    if cli:
        r = invoke([f"--{name}.{key}=1"])
    else:
        path = fresh_dir(workdir) / "unknown_section.toml"
        path.write_text(f"[{name}]\n{key} = 1\n")
        r = invoke(["--config", str(path)])
    msg = assert_clean_failure(r, f"unknown section [{name}]",
                               "Accepted sections: " + ", ".join(f"[{s}]" for s in SECTIONS) + ".")
    if is_typo and len(name) >= 3:
        guess = re.search(r"Did you mean \[([^\]]+)\]\?", msg)
        assert guess and guess.group(1) in SECTIONS, msg
    count("2 unknown section")


ALL_KEYS = sorted({f.name for _, f in FIELDS})


@fuzz(20)
@given(key=st.one_of(IDENT, st.sampled_from(ALL_KEYS)), value=st.one_of(*TOML_SCALARS.values()))
def test_a_setting_outside_any_section_is_refused(workdir, key, value):
    assume(key != "extends")
    path = fresh_dir(workdir) / "top.toml"
    path.write_text(f"{key} = {toml_literal(value)}\n")
    msg = assert_clean_failure(invoke(["--config", str(path)]), "top.toml", f"'{key} = ",
                               "outside any section")
    if key in ALL_KEYS:
        assert "Did you mean to put it under [" in msg
    count("2 outside any section")


@fuzz(40)
@given(case=st.one_of(
    st.tuples(st.just("int"), st.sampled_from(["--world-size", "--rank", "--gpus-per-node", "--jobs"]),
              st.one_of(NOT_NUMBERS, st.integers(-10, 0).map(str), st.sampled_from(["²", "-1", "+3", " 2"]))),
    st.tuples(st.just("unknown"), IDENT.map(lambda s: "--" + s), st.just("")),
    st.tuples(st.just("novalue"), st.sampled_from(["--print-config", "--dry-run", "--debug"]), TEXT),
    st.tuples(st.just("missing"), st.sampled_from(["--config", "--gpu", "--world-size", "--rank"]), st.just("")),
    st.tuples(st.just("stray"), st.one_of(IDENT, st.sampled_from(["-x", "--.x", "--training.", "-"])), st.just("")),
))
def test_bad_flags_are_refused_by_name(case):
    kind, flag, value = case
    if kind == "int":
        least = 0 if flag == "--rank" else 1
        assume(not (value.isdecimal() and int(value) >= least))
        msg = assert_clean_failure(invoke([f"{flag}={value}"]), f"{flag}={value} must be an integer >= {least}")
    elif kind == "unknown":
        assume(flag not in ("--config", "--gpu", "--world-size", "--rank", "--gpus-per-node", "--jobs", "--help",
                            "--print-config", "--dry-run", "--debug"))
        msg = assert_clean_failure(invoke([flag]), f"unknown flag {flag}", "--config NAME_OR_PATH")
    elif kind == "novalue":
        msg = assert_clean_failure(invoke([f"{flag}={value}"]), f"{flag} takes no value")
    elif kind == "missing":
        msg = assert_clean_failure(invoke([flag]), f"{flag} needs a value")
    else:
        assume(flag != "-h")
        msg = assert_clean_failure(invoke([flag]), f"unexpected argument '{flag}'",
                                   "--section.key=value")
    assert msg
    count("2 bad flag")


# ---------------------------------------------------------------- 3. degrees

def degree_args(degrees: dict, in_file: bool, workdir: Path) -> list[str]:
    """The degrees on the command line, or in a file that extends debug_2d."""
    if not in_file:
        return ["--config", "debug_2d", *(f"--parallelism.{k}={v}" for k, v in degrees.items())]
    path = fresh_dir(workdir) / "layout.toml"
    path.write_text('extends = "debug_2d"\n[parallelism]\n' + "".join(f"{k} = {v}\n" for k, v in degrees.items()))
    return ["--config", str(path)]


DEG = st.integers(1, 8)


@fuzz(60)
@given(world=st.integers(1, 64), dpr=DEG, dps=DEG, tp=DEG, pp=DEG, in_file=st.booleans())
def test_degrees_that_do_not_multiply_to_the_world_size(workdir, world, dpr, dps, tp, pp, in_file):
    product = pp * dpr * dps * tp
    assume(product != world)
    r = invoke(degree_args(dict(dp_replicate=dpr, dp_shard=dps, tp=tp, pp=pp), in_file, workdir), world)
    assert_clean_failure(r, f"pp*dp_replicate*dp_shard*tp = {pp}*{dpr}*{dps}*{tp} = {product}",
                         f"the world size is {world}")
    count("3 product != world size")


@fuzz(30)
@given(world=st.integers(1, 64), dpr=DEG, tp=DEG, pp=DEG, in_file=st.booleans())
def test_dp_shard_cannot_be_inferred(workdir, world, dpr, tp, pp, in_file):
    others = pp * dpr * tp
    assume(world % others)
    r = invoke(degree_args(dict(dp_replicate=dpr, dp_shard=-1, tp=tp, pp=pp), in_file, workdir), world)
    assert_clean_failure(r, f"cannot infer dp_shard: world size {world} is not divisible by "
                            f"pp*dp_replicate*tp = {pp}*{dpr}*{tp} = {others}")
    count("3 dp_shard not inferable")


@fuzz(40)
@given(name=st.sampled_from(["dp_replicate", "dp_shard", "tp", "pp"]), value=st.integers(-2**40, 0),
       world=st.integers(1, 16), in_file=st.booleans())
def test_zero_and_negative_degrees(workdir, name, value, world, in_file):
    assume(not (name == "dp_shard" and value == -1))
    meta = next(f.metadata for s, f in FIELDS if s == "parallelism" and f.name == name)
    r = invoke(degree_args({name: value}, in_file, workdir), world)
    where = f"[parallelism] {name} = {value}" if in_file else f"--parallelism.{name}={value}"
    assert_clean_failure(r, where, f"is out of range; accepted: {describe_accepted(meta)}")
    count("3 degree <= 0")


@fuzz(50)
@given(tp=st.integers(2, 24), dps=st.integers(1, 4), vocab=st.one_of(st.just(0), st.integers(TOKENIZER_VOCAB, 2048)),
       seq_len=st.sampled_from([128, 96, 100, 130, 2, 3]), sp=st.booleans())
def test_tp_that_does_not_divide_the_model(tp, dps, vocab, seq_len, sp):
    sizes = dict(DEBUG_SIZES, **{"vocab size": vocab or PADDED_VOCAB})
    problems = [f"tp={tp} does not divide the {what} ({size})" for what, size in sizes.items() if size % tp]
    if sp and seq_len % tp:
        problems.append(f"seq_len={seq_len} is not divisible by tp={tp}")
    assume(problems)
    r = invoke(["--config", "debug_2d", f"--parallelism.tp={tp}", f"--parallelism.dp_shard={dps}",
                f"--model.vocab_size={vocab}", f"--training.seq_len={seq_len}",
                f"--parallelism.sequence_parallel={sp}"], tp * dps)
    assert_clean_failure(r, "layout does not fit the model", *problems)
    count("3 tp does not divide the model")


@fuzz(30)
@given(schedule=st.sampled_from(PP_SCHEDULES), pp=st.integers(2, 12), explicit=st.booleans(),
       extra=st.integers(2, 4))
def test_more_pipeline_stages_than_layers(schedule, pp, explicit, extra):
    per_rank = 1 if schedule in ONE_STAGE else 2 if schedule in V_SHAPED else extra
    default = 1 if schedule in ONE_STAGE else 2
    assume(explicit or per_rank == default)
    assume(pp * per_rank > DEBUG_LAYERS)
    argv = ["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", f"--parallelism.pp={pp}",
            f"--parallelism.pp_schedule={schedule}"]
    if explicit:
        argv.append(f"--parallelism.pp_stages_per_rank={per_rank}")
    assert_clean_failure(invoke(argv, pp), f'[parallelism] pp = {pp}, pp_schedule = "{schedule}"',
                         f"{pp * per_rank} pipeline stages for {DEBUG_LAYERS} layers")
    count("3 stages > layers")


# ---------------------------------------------------------------- 4. batches and micro-batches

@st.composite
def batch_mismatch(draw):
    """(overrides, world size, expected substrings): one batch rule broken, the layout fine."""
    dpr, dps, tp = draw(st.sampled_from([1, 2])), draw(st.integers(1, 4)), draw(st.sampled_from([1, 2]))
    dp = dpr * dps
    layout = [f"--parallelism.dp_replicate={dpr}", f"--parallelism.dp_shard={dps}", f"--parallelism.tp={tp}"]
    kind = draw(st.sampled_from(["local_not_divisor", "not_multiple_of_dp_local", "not_multiple_of_dp"]))
    if kind == "local_not_divisor":  # refused by the config itself
        local = draw(st.integers(2, 64))
        gbs = local * draw(st.integers(0, 8)) + draw(st.integers(1, local - 1))
        expect = [f"command line: --training.local_batch_size={local} must divide global_batch_size = {gbs}"]
    elif kind == "not_multiple_of_dp_local":
        assume(dp > 1)
        local = draw(st.integers(1, 16))
        k = draw(st.integers(1, 40).filter(lambda k: k % dp))
        gbs = local * k
        expect = [f"[training] global_batch_size = {gbs} must be a multiple of dp * local_batch_size = "
                  f"{dpr}*{dps} * {local} = {dp * local}"]
    else:  # local_batch_size 0: global/dp each, so global must be a multiple of dp
        assume(dp > 1)
        local = 0
        gbs = draw(st.integers(1, 200).filter(lambda g: g % dp))  # includes global < dp
        expect = [f"[training] global_batch_size = {gbs} must be a multiple of dp = {dpr}*{dps} = {dp}"]
    argv = [*layout, f"--training.global_batch_size={gbs}", f"--training.local_batch_size={local}"]
    return argv, dp * tp, expect


@fuzz(60)
@given(case=batch_mismatch())
def test_global_and_local_batch_sizes_that_do_not_fit_dp(case):
    argv, world, expect = case
    assert_clean_failure(invoke(["--config", "debug_2d", *argv], world), *expect)
    count("4 batch sizes")


@fuzz(40)
@given(schedule=st.sampled_from(ONE_STAGE), pp=st.integers(2, DEBUG_LAYERS), dps=st.integers(1, 2),
       local=st.integers(1, 16), accumulate=st.booleans(), micro=st.integers(1, 17))
def test_microbatches_that_do_not_divide_the_local_batch(schedule, pp, dps, local, accumulate, micro):
    assume(local % micro)
    steps = 2 if accumulate else 1  # global = dp * local * gradient-accumulation steps
    argv = ["--config", "debug_2d", "--parallelism.tp=1", f"--parallelism.dp_shard={dps}", f"--parallelism.pp={pp}",
            f"--parallelism.pp_schedule={schedule}", f"--parallelism.pp_microbatches={micro}",
            f"--training.global_batch_size={dps * local * steps}",
            f"--training.local_batch_size={local if accumulate else 0}"]
    assert_clean_failure(invoke(argv, pp * dps), f'[parallelism] pp = {pp}, pp_schedule = "{schedule}"',
                         f"pp_microbatches = {micro} must divide", f"(local batch {local})")
    count("4 micro-batches")


@fuzz(30)
@given(schedule=st.sampled_from(ONE_STAGE + V_SHAPED), pp=st.integers(2, 4), per_rank=st.integers(1, 8))
def test_schedules_with_the_wrong_stages_per_rank(schedule, pp, per_rank):
    if schedule in ONE_STAGE:
        assume(per_rank != 1)
        expect = f"{schedule} runs one stage per rank, but pp_stages_per_rank = {per_rank}"
    else:
        assume(per_rank != 2)
        expect = f"{schedule} needs exactly 2 stages per rank (a V shape), but pp_stages_per_rank = {per_rank}"
    argv = ["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", f"--parallelism.pp={pp}",
            f"--parallelism.pp_schedule={schedule}", f"--parallelism.pp_stages_per_rank={per_rank}"]
    assert_clean_failure(invoke(argv, pp), f'[parallelism] pp = {pp}, pp_schedule = "{schedule}"', expect)
    count("4 stages per rank")


# ---------------------------------------------------------------- 5. out of range

def _below(typ, bound, inclusive: bool):
    if typ is int:
        return st.integers(max_value=bound if inclusive else bound - 1)
    floats = st.floats(max_value=bound, exclude_max=not inclusive)
    ints = st.integers(min_value=-10**30, max_value=math.ceil(bound) - (0 if inclusive else 1))
    return st.one_of(floats, ints.map(float))


def _above(typ, bound, inclusive: bool):
    if typ is int:
        return st.one_of(st.integers(min_value=bound if inclusive else bound + 1),
                         st.integers(min_value=bound + 1, max_value=bound + 10**30))  # huge ones too
    return st.floats(min_value=bound, exclude_min=not inclusive)


def _violates(meta, v) -> bool:
    """Independently of the validator: v breaks one of the bounds (-0.0 is not < 0)."""
    return (v != v or ("min" in meta and v < meta["min"]) or ("max" in meta and v > meta["max"])
            or ("gt" in meta and v <= meta["gt"]) or ("lt" in meta and v >= meta["lt"]))


def out_of_range(typ, meta):
    """A value of the right type outside the field's range (its `also` values excepted)."""
    item = list[int].__args__[0] if typ == list[int] else typ
    options = []
    if "min" in meta:
        options.append(_below(item, meta["min"], inclusive=False))
    if "gt" in meta:
        options.append(_below(item, meta["gt"], inclusive=True))
    if "max" in meta:
        options.append(_above(item, meta["max"], inclusive=False))
    if "lt" in meta:
        options.append(_above(item, meta["lt"], inclusive=True))
    if item is float:
        options.append(st.just(math.nan))
    bad = st.one_of(*options).filter(lambda v: v not in meta.get("also", ()) and _violates(meta, v))
    if typ == list[int]:
        return st.tuples(st.lists(st.integers(1, 100), max_size=3), bad).map(lambda t: sorted(t[0]) + [t[1]])
    return bad


@pytest.mark.parametrize("section,f", RANGED, ids=ids(RANGED))
@fuzz(PER_FIELD)
@given(data=st.data(), cli=st.booleans(), separate=st.booleans())
def test_out_of_range_values_name_the_key_and_the_range(workdir, section, f, data, cli, separate):
    value = data.draw(out_of_range(f.type, f.metadata), label=f"{section}.{f.name}")
    if cli:
        raw = ",".join(map(str, value)) if isinstance(value, list) else cli_number(value)
        r = invoke(["--config", "debug_2d", *cli_tokens(section, f.name, raw, separate)])
        # The range is checked on the parsed value: a list shows as [..] whatever was typed.
        shown = f"[{', '.join(map(str, value))}]" if isinstance(value, list) else raw
        where = f"command line: --{section}.{f.name}={shown}"
    else:
        path = fresh_dir(workdir) / "range.toml"
        path.write_text(toml_setting(section, f.name, value))
        r = invoke(["--config", str(path)])
        where = f"range.toml: [{section}] {f.name} = "
    assert_clean_failure(r, where, f"is out of range; accepted: {describe_accepted(f.metadata)}.")
    count("5 out of range")


@pytest.mark.parametrize("section,f", CHOICE, ids=ids(CHOICE))
@fuzz(PER_FIELD)
@given(data=st.data(), cli=st.booleans())
def test_values_outside_the_choices_list_them(workdir, section, f, data, cli):
    listed = f.type == list[str]  # a list of choices ([metrics] trackers): one wrong item
    value = data.draw(st.one_of(TEXT, *(typo(c) for c in choices(f.metadata) if len(c) > 1))
                      .filter(lambda v: v not in choices(f.metadata))
                      .filter(lambda v: not listed or (v and v.strip() == v and "," not in v)),
                      label=f"{section}.{f.name}")
    if cli:
        r = invoke(["--config", "debug_2d", f"--{section}.{f.name}={value}"])
        where = f"command line: --{section}.{f.name}={[value] if listed else value}"  # a list shows as [..]
    else:
        path = fresh_dir(workdir) / "choice.toml"
        path.write_text(toml_setting(section, f.name, [value] if listed else value))
        r = invoke(["--config", str(path)])
        where = f"choice.toml: [{section}] {f.name} = "
    assert_clean_failure(r, where, "is not accepted", f"Accepted values: {describe_accepted(f.metadata)}.")
    count("5 not a choice")


def any_cli_value(typ):
    """A well-typed command-line value, sensible or not: huge, negative, inf, nan, any text."""
    if typ is int:
        return st.one_of(st.integers(), st.integers(-2**70, 2**70), st.integers(-2**64, 2**64).map(lambda v: v * 2**40)).map(str)
    if typ is float:
        return st.floats().map(cli_number)
    if typ is bool:
        return st.sampled_from(BOOL_WORDS)
    if typ == list[int]:
        return st.lists(st.integers(-2**70, 2**70), max_size=4).map(lambda xs: ",".join(map(str, xs)))
    return TEXT


@pytest.mark.parametrize("section,f", FIELDS, ids=ids(FIELDS))
@fuzz(PER_FIELD)
@given(data=st.data())
def test_any_value_of_any_field_passes_every_check_or_is_refused_cleanly(section, f, data):
    """Independent of the schema's declared ranges: whatever the value, train.run either gets
    past every check (to the process group) or refuses it with a message; it never crashes."""
    raw = data.draw(any_cli_value(f.type), label=f"{section}.{f.name}")
    assume(not (f.type is str and os.path.exists(raw)))  # an existing file as a tokenizer: not this test
    r = invoke(["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", f"--{section}.{f.name}={raw}"])
    if r.reached is None:
        assert_clean_failure(r)
    else:
        assert r.crash is None and not r.stderr and not dist.is_initialized(), r
    count("5 any value: accepted or refused")


@fuzz(20)
@given(vocab=st.integers(1, TOKENIZER_VOCAB - 1))
def test_vocab_smaller_than_the_tokenizer(vocab):
    r = invoke(["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", f"--model.vocab_size={vocab}"])
    assert_clean_failure(r, f"[model] vocab_size = {vocab} is smaller than the tokenizer's vocabulary "
                            f"({TOKENIZER_VOCAB})")
    count("5 vocab < tokenizer")


# ---------------------------------------------------------------- 6. files

def _not_toml(data: bytes) -> bool:
    try:
        tomllib.loads(data.decode())
        return False
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True


@fuzz(40)
@given(data=st.binary(min_size=1, max_size=64))
def test_random_bytes_are_not_toml(workdir, data):
    assume(_not_toml(data))
    path = fresh_dir(workdir) / "bytes.toml"
    path.write_bytes(data)
    assert_clean_failure(invoke(["--config", str(path)]), "bytes.toml: not valid TOML")
    count("6 random bytes")


SHIPPED_TEXT = (CONFIGS_DIR / "debug_2d.toml").read_text()


@st.composite
def broken_config(draw):
    """debug_2d.toml with one line broken: a bracket gone or doubled, a key or section
    given twice, a value or `=` missing."""
    lines = SHIPPED_TEXT.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("[")]
    settings_ = [i for i, line in enumerate(lines) if re.match(r"\w+ = ", line)]
    how = draw(st.sampled_from(["no ]", "no [", "[[", "duplicate key", "duplicate section", "no value",
                                "no =", "open string"]))
    i = draw(st.sampled_from(headers if how in ("no ]", "no [", "[[", "duplicate section") else settings_))
    line = lines[i]
    key = line.split(" = ")[0]
    if how == "no ]":
        lines[i] = line.replace("]", "", 1)
    elif how == "no [":
        lines[i] = line.replace("[", "", 1)
    elif how == "[[":
        lines[i] = "[" + line
    elif how == "duplicate key":
        again = draw(st.sampled_from(["1", "true", '"x"']))
        lines.insert(i + 1, f"{key} = {again}")
    elif how == "duplicate section":
        lines.append(line)
    elif how == "no value":
        lines[i] = f"{key} ="
    elif how == "no =":
        lines[i] = line.replace(" = ", " ", 1)
    else:
        lines[i] = f'{key} = "unterminated'
    return "\n".join(lines) + "\n", how


@fuzz(40)
@given(case=broken_config())
def test_malformed_toml_names_the_file(workdir, case):
    text, how = case
    assume(_not_toml(text.encode()))  # "[[x]" is an array of tables, "no [" may still parse
    path = fresh_dir(workdir) / "broken.toml"
    path.write_text(text)
    assert_clean_failure(invoke(["--config", str(path)]), "broken.toml: not valid TOML")
    count("6 malformed TOML")


def _candidates(name: str) -> list:
    return [d / n for d in (Path(), CONFIGS_DIR, Path.cwd() / "configs") for n in (name, f"{name}.toml")]


@fuzz(40)
@given(name=st.one_of(IDENT, TEXT, st.from_regex(r"[a-z]{1,8}(/[a-z]{1,8}){1,3}(\.toml)?", fullmatch=True),
                      st.integers(256, 400).map(lambda n: "x" * n),  # longer than a file name may be
                      st.integers(5, 60).map(lambda n: "/".join(["d" * 200] * n))),
       form=st.sampled_from(["=", " "]))
def test_missing_config_file_lists_the_available_ones(name, form):
    assume("\x00" not in name and not any(os.path.isfile(p) for p in _candidates(name)))
    argv = [f"--config={name}"] if form == "=" else ["--config", name]
    assert_clean_failure(invoke(argv), f"config '{name}' not found",
                         "Available configs: " + ", ".join(available_configs()))
    count("6 missing config")


def test_a_folder_is_not_a_config(tmp_path):
    assert_clean_failure(invoke(["--config", str(tmp_path)]), f"config '{tmp_path}' not found")


def test_unreadable_config_file(tmp_path):
    path = tmp_path / "secret.toml"
    path.write_text("[training]\nsteps = 3\n")
    path.chmod(0)
    try:
        # root (as in most CI containers) reads a mode-000 file anyway: nothing to test then.
        if os.access(path, os.R_OK):
            pytest.skip("running as root: a chmod 000 file is still readable")
        assert_clean_failure(invoke(["--config", str(path)]), "secret.toml: cannot read the file",
                             "Permission denied")
    finally:
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)


@fuzz(30)
@given(names=st.lists(IDENT, min_size=1, max_size=5, unique=True), lead=st.integers(0, 2),
       suffix=st.booleans(), dot=st.booleans())
def test_extends_cycles_are_refused_with_the_cycle(workdir, names, lead, suffix, dot):
    """`lead` files that extend into a cycle of len(names) files."""
    assume(not set(names) & set(available_configs()))
    d = fresh_dir(workdir)
    ring = [f"c_{n}" for n in names]
    chain = [f"lead{i}" for i in range(lead)] + ring
    for i, name in enumerate(chain):
        parent = chain[i + 1] if i + 1 < len(chain) else ring[0]
        spelled = ("./" if dot else "") + parent + (".toml" if suffix else "")
        (d / f"{name}.toml").write_text(f'extends = "{spelled}"\n[training]\nsteps = {i + 1}\n')
    msg = assert_clean_failure(invoke(["--config", str(d / f"{chain[0]}.toml")]), "`extends` goes round in a circle",
                               *(f"/{n}.toml" for n in ring))
    assert msg.count(f"/{ring[0]}.toml") == 2  # where the circle closes
    count("6 extends cycle")


@fuzz(30)
@given(depth=st.integers(0, 3), missing=st.one_of(IDENT, st.from_regex(r"\.\./[a-z]{1,6}/[a-z]{1,6}", fullmatch=True),
                                                   st.integers(256, 300).map(lambda n: "p" * n)))
def test_extends_a_missing_parent(workdir, depth, missing):
    assume(missing not in available_configs() and missing != "last" and not missing.startswith("lead"))
    d = fresh_dir(workdir)
    chain = [f"lead{i}" for i in range(depth)] + ["last"]
    for i, name in enumerate(chain):
        parent = chain[i + 1] if i + 1 < len(chain) else missing
        (d / f"{name}.toml").write_text(f"extends = {json.dumps(parent)}\n")
    assert_clean_failure(invoke(["--config", str(d / f"{chain[0]}.toml")]), "last.toml: extends = ",
                         f"{json.dumps(missing)}: no such file")
    count("6 extends missing")


@fuzz(20)
@given(parent=st.one_of(TOML_SCALARS["int"], TOML_SCALARS["float"], TOML_SCALARS["bool"], TOML_SCALARS["date"],
                        TOML_LIST, TOML_TABLE))
def test_extends_must_be_a_string(workdir, parent):
    path = fresh_dir(workdir) / "ext.toml"
    path.write_text(f"extends = {toml_literal(parent)}\n")
    assert_clean_failure(invoke(["--config", str(path)]), "ext.toml: extends = ", "must be a string")
    count("6 extends not a string")


@fuzz(30)
@given(which=st.sampled_from(["tokenizer", "dataset_path", "initial_load_hf"]),
       name=st.one_of(IDENT, st.from_regex(r"/nonexistent/[a-z]{1,8}(\.json)?", fullmatch=True),
                      st.integers(256, 300).map(lambda n: "q" * n)))
def test_files_named_by_settings_must_exist(which, name):
    """Checked before the process group: the tokenizer, the text corpus, the HF folder."""
    assume(name != "byte" and not os.path.exists(name))
    if which == "tokenizer":
        argv, expect = [f"--training.tokenizer={name}"], ["tokenizer", f"no file at '{name}'"]
    elif which == "dataset_path":
        argv = ["--training.dataset=text", f"--training.dataset_path={name}"]
        expect = ['[training] dataset = "text" needs dataset_path', f'"{name}" does not exist']
    else:
        argv, expect = [f"--checkpoint.initial_load_hf={name}"], [f'[checkpoint] initial_load_hf = "{name}"']
    r = invoke(["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", *argv])
    assert_clean_failure(r, *expect)
    count("6 missing file in a setting")


# ---------------------------------------------------------------- what the fuzzing found, pinned

def _file(name: str, content: bytes):
    def make(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(content)
        return ["--config", str(tmp / name)]
    return make


ONE = ["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1"]
FOUND = [  # (argv or a function of a folder returning it, world size, substrings of the message)
    # global < dp with local_batch_size 0: ZeroDivisionError in check_layout
    (ONE + ["--parallelism.dp_shard=4", "--training.global_batch_size=2"], 4,
     ["[training] global_batch_size = 2 must be a multiple of dp = 1*4 = 4"]),
    # not UTF-8: tomllib's UnicodeDecodeError, whose message named no file
    (_file("latin1.toml", b"[job]\nname = \"caf\xe9\"\n"), None, ["latin1.toml: not valid TOML: not UTF-8 text"]),
    # names too long for the filesystem: OSError (ENAMETOOLONG) from Path.is_file
    (["--config", "x" * 300], None, [f"config '{'x' * 300}' not found"]),
    (_file("long.toml", b'extends = "' + b"p" * 300 + b'"\n'), None, ["long.toml: extends = ", "no such file"]),
    (ONE + ["--checkpoint.initial_load_hf=" + "q" * 300], None, ["[checkpoint] initial_load_hf = "]),
    # sizes that overflow torch's int64 shapes on the meta model: RuntimeError / TypeError
    (ONE + [f"--model.vocab_size={2**63}"], None, ["--model.vocab_size=", "is out of range"]),
    (ONE + [f"--training.seq_len={2**62}"], None, ["--training.seq_len=", "is out of range"]),
    # "²".isdigit() is True but int("²") fails: a message that named no flag
    (["--world-size=²"], None, ["command line: --world-size=² must be an integer >= 1"]),
    # an unknown dataset, or text without a path, got past the process group and model init
    (ONE + ["--training.dataset=stdlb"], None, ["--training.dataset=stdlb is not accepted", 'Did you mean "stdlib"?']),
    (ONE + ["--training.dataset=text"], None, ['[training] dataset = "text" needs dataset_path']),
]
if "comm" in SECTIONS:  # collective timeouts that timedelta cannot hold: OverflowError in build_mesh
    FOUND += [(ONE + [f"--comm.{k}={v}"], None, [f"command line: --comm.{k}=", "is out of range"])
              for k in ("init_timeout_seconds", "train_timeout_seconds") for v in ("inf", "1e+14")]


@pytest.mark.parametrize("argv,world,needles", FOUND, ids=[str(i) for i in range(len(FOUND))])
def test_cases_the_fuzzing_found(tmp_path, argv, world, needles):
    assert_clean_failure(invoke(argv(tmp_path) if callable(argv) else argv, world), *needles)


# ---------------------------------------------------------------- the harness is not trivially passing

@st.composite
def good_overrides(draw):
    """(argv overrides, world size, expected key=value lines in --print-config)."""
    tp = draw(st.sampled_from([1, 2, 4]))
    dpr, dps = draw(st.sampled_from([1, 2])), draw(st.integers(1, 3))
    dp = dpr * dps
    seq_len = tp * draw(st.integers(2, 32))
    settings_ = {
        "parallelism.tp": tp, "parallelism.dp_replicate": dpr, "parallelism.dp_shard": dps,
        "training.seq_len": seq_len, "training.global_batch_size": dp * draw(st.integers(1, 4)),
        "training.steps": draw(st.integers(1, 10**6)), "training.seed": draw(st.integers(-2**40, 2**40)),
        "optimizer.lr": draw(st.floats(1e-8, 1.0)), "optimizer.beta1": draw(st.floats(0, 0.999)),
        "lr_scheduler.decay_type": draw(st.sampled_from(["cosine", "linear", "wsd", "constant"])),
        "lr_scheduler.min_lr_ratio": draw(st.floats(0, 1)), "metrics.log_freq": draw(st.integers(1, 100)),
        "activation_checkpoint.mode": draw(st.sampled_from(["none", "full", "selective", "op"])),
        "job.name": draw(IDENT), "compile.enable": draw(st.booleans()),
        "model.vocab_size": draw(st.sampled_from([0, 320, 384, 512, 1024])),
    }
    argv = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings_.items()]
    return argv, dp * tp, settings_


@fuzz(25)
@given(case=good_overrides())
def test_good_configs_with_random_valid_overrides_pass_every_check(case):
    argv, world, values = case
    shown = invoke(["--config", "debug_2d", *argv, "--print-config"], world)
    assert shown.code == 0 and not shown.stderr and shown.crash is None, shown
    printed = tomllib.loads(shown.stdout)
    for key, value in values.items():
        section, name = key.split(".")
        assert printed[section][name] == value, (key, printed[section][name], value)
    # Without --print-config the same run passes every check and reaches the process group.
    r = invoke(["--config", "debug_2d", *argv], world)
    assert r.crash is None and r.reached == "init_process_group", r
    assert not r.stderr and not dist.is_initialized()
    count("sanity: good configs")


def test_debug_shows_the_traceback():
    r = invoke(["--config", "debug_2d", "--parallelism.tp=3", "--debug"])
    assert r.code == 2 and r.reached is None and r.crash is None
    assert "Traceback" in r.stderr and "meshtrain: error: parallel degrees do not multiply" in r.stderr


# ---------------------------------------------------------------- 7. a checkpoint of another model

def test_checkpoint_of_another_model_is_refused_in_process(tmp_path, monkeypatch):
    """Not before the process group: checkpoints are read through DCP, which needs one. Here
    one process saves a real checkpoint of the debug model (vocab 320) with a gloo group of
    one, then a second run with vocab 384 must refuse it. No torchrun, a few seconds."""
    for key in ENV_KEYS:  # init_distributed sets these for a world of one; put them back after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", "--training.steps=1",
              "--training.seq_len=16", "--training.global_batch_size=2", "--training.dataset=text",
              f"--training.dataset_path={tmp_path / 'corpus.txt'}", f"--job.output_dir={tmp_path}",
              "--job.name=ckpt", "--checkpoint.enable=true", "--metrics.enable_tensorboard=false"]
    err = io.StringIO()
    try:
        start = time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert train.run(common) == 0, err.getvalue()
            assert not dist.is_initialized()  # a successful run takes its group down
            for key in ENV_KEYS:  # the second run picks a fresh port for its own group of one
                os.environ.pop(key, None)
            code = train.run([*common, "--model.vocab_size=384"])
        seconds = time.perf_counter() - start
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    msg = err.getvalue().strip()
    assert code == 2 and "Traceback" not in msg, msg
    assert msg.startswith("meshtrain: error: checkpoint ") and msg.count("meshtrain: error:") == 1, msg
    assert "step-00000001" in msg and "is of another model (vocab_size: checkpoint 320 vs this run 384)" in msg
    assert seconds < 20, seconds  # ~1 s measured (train one step, save, start again, refuse)


def test_zz_report_example_counts(capsys):
    """Runs last (file order): how many generated cases each family ran."""
    with capsys.disabled():
        total = sum(EXAMPLES.values())
        print(f"\nbad-input fuzz: {total} generated cases: "
              + ", ".join(f"{k}: {v}" for k, v in sorted(EXAMPLES.items())))
