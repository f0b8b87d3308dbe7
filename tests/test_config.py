"""Config loading: precedence, syntax, `extends`, round-trips, and the error messages."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from meshtrain.training.config import PP_SCHEDULES, SECTIONS, ConfigError, JobConfig, choices, default_of
from meshtrain.training.config_loader import (CONFIGS_DIR, config_to_dict, config_to_toml, format_help, load_config,
                                    parse_args, tomllib, validate)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return str(e.value)


def changed(section) -> object:
    """The section with every field set to a valid non-default value (where one exists)."""
    new = {}
    for f in dataclasses.fields(section):
        v, meta = default_of(f), f.metadata
        if "choices" in meta and isinstance(v, list):  # a list of choices: another of them
            new[f.name] = [next(c for c in choices(meta) if c not in v)]
        elif "choices" in meta:
            new[f.name] = next((c for c in choices(meta) if c != v), v)
        elif f.type is bool:
            new[f.name] = not v
        elif f.type is int:
            new[f.name] = 3 if v in meta.get("also", ()) else v + 1
        elif f.type is float:
            new[f.name] = 0.5 if not v or v in meta.get("also", ()) else v / 2
        elif f.type == list[int]:
            new[f.name] = v + [3, 7]
        elif f.type == list[str]:
            new[f.name] = v + ["a.*.b=colwise", 'back\\slash "quoted"=é']
        else:  # a string that needs every kind of TOML escaping
            new[f.name] = v + ' "quoted" back\\slash\ttab\nnewline é \x7f'
    return dataclasses.replace(section, **new)


# ---------------------------------------------------------------- round trips

def test_defaults_load_without_a_file():
    assert load_config() == JobConfig()


def test_every_section_round_trips_through_toml(tmp_path):
    base = JobConfig()
    cfg = dataclasses.replace(base, **{n: changed(getattr(base, n)) for n in SECTIONS})
    # The changed family is gpt2; the hf_* keys (changed too) belong to name = "hf", whose
    # hf_config must be a real config.json.
    cfg.model.name, cfg.model.hf_config = "hf", str(ROOT / "configs" / "hf" / "qwen2-tiny")
    # [validation] split (held-out training data) and dataset (a corpus of its own) exclude
    # each other: the dataset round-trips here, split in test_validation.py.
    cfg.validation.dataset, cfg.validation.split = "text", 0.0
    # A pipeline and [checkpoint] export_hf_interval exclude each other: pp stays 1 here
    # (configs with pp > 1, debug_3d, are read by the pipeline tests).
    cfg.parallelism.pp = 1
    # [moe] belongs to name = "moe": round-tripped below, with that family.
    moe = dataclasses.replace(base, model=dataclasses.replace(base.model, name="moe"), moe=cfg.moe)
    cfg.moe = base.moe
    # [optimizer] name = "Muon" (the changed name) excludes [lora] and cpu_offload (changed
    # too): [optimizer] round-trips alone.
    muon = dataclasses.replace(base, optimizer=cfg.optimizer)
    cfg.optimizer = base.optimizer
    # [fault_tolerance] enable excludes dp_replicate > 1 (changed too), and its lighthouse must
    # be an address: it round-trips alone, with one.
    ft = dataclasses.replace(base, fault_tolerance=dataclasses.replace(
        cfg.fault_tolerance, lighthouse="http://lighthouse.example:29511"))
    cfg.fault_tolerance = base.fault_tolerance
    # [training] chunked_loss excludes [compile] loss (changed too): it round-trips alone.
    chunked = dataclasses.replace(base, training=dataclasses.replace(base.training, chunked_loss=True))
    cfg.training.chunked_loss = False
    validate(cfg)
    validate(chunked)
    validate(moe)
    validate(muon)
    validate(ft)
    own = {"moe": moe, "optimizer": muon, "fault_tolerance": ft}
    for name in SECTIONS:  # every field is off its default, unless it has only one choice
        for f in dataclasses.fields(getattr(own.get(name, cfg), name)):
            if (name, f.name) in (("validation", "split"), ("parallelism", "pp"), ("training", "chunked_loss")):
                continue
            if "choices" not in f.metadata or len(choices(f.metadata)) > 1:
                assert getattr(getattr(own.get(name, cfg), name), f.name) != f.default, (name, f.name)
    for each in (cfg, moe, muon, ft, chunked):
        path = write(tmp_path, "all.toml", config_to_toml(each))
        assert load_config(path) == each
        assert tomllib.loads(config_to_toml(each)) == config_to_dict(each)


def test_defaults_round_trip_through_toml(tmp_path):
    assert load_config(write(tmp_path, "d.toml", config_to_toml(JobConfig()))) == JobConfig()


def test_every_field_documents_itself():
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help"
            assert f"--{name}.{f.name}=" in format_help()


def test_reading_a_config_imports_no_torch():
    """Families and flavors come from models/registry.py, whose model configs need no torch."""
    code = ("import sys; from training.config_loader import load_config; load_config('debug_2d'); "
            "load_config('gpt2_debug_3d'); assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=CONFIGS_DIR.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_flavor_of_the_other_family_is_refused_naming_both_keys():
    msg = error(load_config, None, ["--model.flavor=124M"])
    assert "--model.flavor=124M is not a llama flavor" in msg and '[model] name = "llama"' in msg
    assert "405B" in msg
    assert load_config(None, ["--model.name=gpt2", "--model.flavor=124M"]).model.flavor == "124M"


def test_gradient_sync_every_microbatch_is_refused_under_a_pipeline_naming_the_key():
    msg = error(load_config, "debug_3d", ["--parallelism.gradient_sync=microbatch"])
    assert "--parallelism.gradient_sync=microbatch" in msg and "pp = 2" in msg and '"step" or "auto"' in msg
    assert load_config("debug_3d", ["--parallelism.gradient_sync=step"]).parallelism.gradient_sync == "step"
    msg = error(load_config, "debug_2d", ["--parallelism.gradient_sync=steps"])
    assert "Did you mean \"step\"?" in msg and '"auto", "microbatch", "step"' in msg


def test_pipeline_schedules_match_parallel_and_the_installed_torch():
    from torch.distributed.pipelining.schedules import get_schedule_class

    from meshtrain.parallel.pipeline import SCHEDULES
    assert tuple(SCHEDULES) == PP_SCHEDULES
    for name in PP_SCHEDULES:
        get_schedule_class(name)  # raises for a name this torch does not have


# ---------------------------------------------------------------- precedence and syntax

def test_command_line_beats_file_beats_defaults(tmp_path):
    path = write(tmp_path, "run.toml", "[training]\nsteps = 7\nseq_len = 64\n")
    cfg = load_config(path, ["--training.steps=9"])
    assert cfg.training.steps == 9          # command line
    assert cfg.training.seq_len == 64       # file
    assert cfg.training.global_batch_size == 8  # default


@pytest.mark.parametrize("tokens", [["--training.steps=5"], ["--training.steps", "5"]])
def test_both_override_syntaxes(tokens):
    assert load_config(None, tokens).training.steps == 5


def test_negative_number_as_separate_value_token():
    assert load_config(None, ["--parallelism.dp_shard", "-1"]).parallelism.dp_shard == -1
    cfg, _ = parse_args(["--parallelism.dp_shard", "-1", "--parallelism.tp", "2"])
    assert (cfg.parallelism.dp_shard, cfg.parallelism.tp) == (-1, 2)


def test_later_override_wins():
    assert load_config(None, ["--training.steps=5", "--training.steps", "6"]).training.steps == 6


@pytest.mark.parametrize("word,value", [("true", True), ("false", False), ("1", True), ("0", False),
                                        ("yes", True), ("no", False), ("TRUE", True), ("No", False)])
def test_bool_words_on_the_command_line(word, value):
    assert load_config(None, [f"--compile.enable={word}"]).compile.enable is value


def test_bool_flag_without_value_means_true():
    cfg = load_config(None, ["--compile.enable", "--training.steps=3"])
    assert cfg.compile.enable is True and cfg.training.steps == 3


def test_bad_bool_word_on_the_command_line():
    msg = error(load_config, None, ["--compile.enable=maybe"])
    assert "command line: --compile.enable=maybe must be true or false" in msg


def test_int_is_accepted_for_a_float_in_toml(tmp_path):
    cfg = load_config(write(tmp_path, "f.toml", "[optimizer]\nlr = 1\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


# ---------------------------------------------------------------- extends

def test_extends_chain_merges_section_by_section(tmp_path):
    write(tmp_path, "grand.toml", "[training]\nsteps = 1\nseq_len = 32\n[optimizer]\nlr = 0.5\n")
    write(tmp_path, "base.toml", 'extends = "grand.toml"\n[training]\nsteps = 2\n')
    (tmp_path / "sub").mkdir()
    child = write(tmp_path / "sub", "child.toml",
                  'extends = "../base.toml"\n[training]\nglobal_batch_size = 4\n')
    cfg = load_config(child, ["--optimizer.lr=0.25"])
    assert cfg.training.steps == 2                # parent beats grandparent
    assert cfg.training.seq_len == 32             # grandparent key survives the merge
    assert cfg.training.global_batch_size == 4    # child
    assert cfg.optimizer.lr == 0.25               # command line beats them all


def test_extends_a_shipped_config_by_name(tmp_path):
    child = write(tmp_path, "mine.toml", 'extends = "debug_2d"\n[training]\nsteps = 3\n')
    cfg = load_config(child)
    assert cfg.training.steps == 3 and cfg.parallelism.tp == 2 and cfg.job.name == "debug_2d"


def test_extends_cycle_is_an_error(tmp_path):
    a = write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", 'extends = "a.toml"\n')
    msg = error(load_config, a)
    assert "circle" in msg and "a.toml" in msg and "b.toml" in msg


def test_extends_itself_is_a_cycle(tmp_path):
    assert "circle" in error(load_config, write(tmp_path, "s.toml", 'extends = "s.toml"\n'))


def test_extends_missing_file(tmp_path):
    msg = error(load_config, write(tmp_path, "c.toml", 'extends = "nope.toml"\n'))
    assert "c.toml" in msg and "nope.toml" in msg and "no such file" in msg


def test_error_names_the_file_in_the_chain_that_has_the_bad_key(tmp_path):
    write(tmp_path, "base.toml", "[training]\nstep = 3\n")
    msg = error(load_config, write(tmp_path, "child.toml", 'extends = "base.toml"\n'))
    assert "base.toml" in msg and "'step'" in msg and "Did you mean 'steps'?" in msg


# ---------------------------------------------------------------- bad input

def test_typo_in_key_suggests_the_real_key(tmp_path):
    path = write(tmp_path, "t.toml", "[parallelism]\ntensor_paralel = 2\n")
    msg = error(load_config, path)
    assert "t.toml" in msg and "'tensor_paralel'" in msg and "[parallelism]" in msg
    assert "Did you mean 'tp'?" in msg
    assert "dp_replicate, dp_shard, tp, pp" in msg  # the accepted keys


def test_typo_in_key_on_the_command_line():
    msg = error(load_config, None, ["--parallelism.tensor_paralel=2"])
    assert msg.startswith("command line: --parallelism.tensor_paralel")
    assert "Did you mean 'tp'?" in msg and "Accepted keys of [parallelism]" in msg


def test_unknown_key_without_a_close_match_lists_accepted_keys(tmp_path):
    msg = error(load_config, write(tmp_path, "u.toml", "[training]\nzzz = 1\n"))
    assert "'zzz'" in msg and "Did you mean" not in msg and "global_batch_size" in msg


def test_unknown_section_suggests_the_real_one(tmp_path):
    msg = error(load_config, write(tmp_path, "s.toml", "[paralelism]\ntp = 2\n"))
    assert "s.toml" in msg and "[paralelism]" in msg and "Did you mean [parallelism]?" in msg
    assert "[activation_checkpoint]" in msg  # the accepted sections


def test_key_outside_any_section(tmp_path):
    msg = error(load_config, write(tmp_path, "o.toml", "steps = 3\n"))
    assert "outside any section" in msg and "[training]" in msg


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path, "w.toml", '[training]\nsteps = "ten"\n')
    assert error(load_config, path).endswith('w.toml: [training] steps = "ten" must be an integer')


def test_bool_is_not_an_integer_in_file(tmp_path):
    msg = error(load_config, write(tmp_path, "b.toml", "[training]\nsteps = true\n"))
    assert "[training] steps = true must be an integer" in msg


def test_number_is_not_a_bool_in_file(tmp_path):
    msg = error(load_config, write(tmp_path, "n.toml", "[compile]\nenable = 1\n"))
    assert "[compile] enable = 1 must be true or false" in msg


def test_wrong_type_on_the_command_line():
    assert (error(load_config, None, ["--training.steps=ten"])
            == "command line: --training.steps=ten must be an integer")


def test_out_of_range_in_file(tmp_path):
    msg = error(load_config, write(tmp_path, "r.toml", "[training]\nsteps = 0\n"))
    assert "r.toml: [training] steps = 0 is out of range; accepted: >= 1" in msg


def test_out_of_range_on_the_command_line():
    msg = error(load_config, None, ["--lr_scheduler.min_lr_ratio=1.5"])
    assert "command line: --lr_scheduler.min_lr_ratio=1.5" in msg and ">= 0 and <= 1" in msg


def test_dp_shard_accepts_minus_one_but_not_zero():
    assert load_config(None, ["--parallelism.dp_shard=-1"]).parallelism.dp_shard == -1
    msg = error(load_config, None, ["--parallelism.dp_shard=0"])
    assert "dp_shard=0" in msg and ">= 1, or -1" in msg


def test_bad_choice_lists_accepted_values(tmp_path):
    msg = error(load_config, write(tmp_path, "c.toml", '[lr_scheduler]\ndecay_type = "cosin"\n'))
    assert 'c.toml: [lr_scheduler] decay_type = "cosin" is not accepted' in msg
    assert 'Did you mean "cosine"?' in msg
    assert '"cosine", "linear", "wsd", "constant"' in msg


def test_bad_flavor_on_the_command_line():
    msg = error(load_config, None, ["--model.flavor=7B"])
    assert "command line: --model.flavor=7B" in msg and '"8B"' in msg and '"405B"' in msg


def test_malformed_toml_names_the_file_and_line(tmp_path):
    msg = error(load_config, write(tmp_path, "bad.toml", "[training]\nsteps = = 3\n"))
    assert "bad.toml" in msg and "not valid TOML" in msg and "line 2" in msg


def test_missing_config_lists_the_available_ones():
    msg = error(load_config, "no_such_config")
    assert "'no_such_config' not found" in msg
    assert "debug_2d" in msg and "llama3_8b" in msg and "llama70b_2d" in msg


def test_local_batch_size_must_divide_global(tmp_path):
    path = write(tmp_path, "l.toml", "[training]\nglobal_batch_size = 8\nlocal_batch_size = 3\n")
    msg = error(load_config, path)
    assert "l.toml: [training] local_batch_size = 3 must divide global_batch_size = 8" in msg
    assert load_config(path, ["--training.local_batch_size=4"]).training.local_batch_size == 4


def test_validate_catches_wrong_types_set_in_code():
    cfg = JobConfig()
    cfg.training.steps = "10"
    assert "[training] steps = \"10\" must be an integer" in error(validate, cfg)


def test_override_needs_a_value():
    assert "--training.steps needs a value" in error(load_config, None, ["--training.steps"])


# ---------------------------------------------------------------- parse_args

def test_parse_args_finds_a_config_by_name_and_reads_the_flags():
    cfg, args = parse_args(["--config", "debug_2d", "--print-config", "--dry-run",
                            "--world-size=4", "--debug", "--training.steps", "3"])
    assert cfg.job.name == "debug_2d" and args.debug and cfg.training.steps == 3
    assert args.print_config and args.dry_run and args.world_size == 4
    assert Path(args.config_path).resolve() == (CONFIGS_DIR / "debug_2d.toml").resolve()


def test_parse_args_without_flags_gives_defaults():
    cfg, args = parse_args([])
    assert cfg == JobConfig() and args.config_path is None
    assert not args.print_config and not args.dry_run and args.world_size is None


@pytest.mark.parametrize("spec", ["debug_2d.toml", "configs/debug_2d.toml", "path"])
def test_config_by_file_name_or_path(spec, monkeypatch):
    monkeypatch.chdir(CONFIGS_DIR.parent)
    spec = str(CONFIGS_DIR / "debug_2d.toml") if spec == "path" else spec
    assert parse_args([f"--config={spec}"])[0].job.name == "debug_2d"


def test_config_name_found_in_working_directory_configs(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    write(tmp_path / "configs", "local_only.toml", '[job]\nname = "here"\n')
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--config", "local_only"])[0].job.name == "here"


def test_unknown_flag_is_an_error():
    msg = error(parse_args, ["--steps", "3"])
    assert "unknown flag --steps" in msg and "--config" in msg


def test_world_size_must_be_a_positive_integer():
    assert "--world-size=abc must be an integer >= 1" in error(parse_args, ["--world-size", "abc"])
    assert "--rank=-1 must be an integer >= 0" in error(parse_args, ["--rank=-1"])
    assert "--jobs=0 must be an integer >= 1" in error(parse_args, ["--jobs", "0"])
    assert parse_args(["--check-collectives", "--jobs=3"])[1].jobs == 3


def test_help_prints_every_key_and_exits(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0 and "--parallelism.tp=1" in capsys.readouterr().out


# ---------------------------------------------------------------- shipped configs

SHIPPED = sorted(CONFIGS_DIR.glob("*.toml"))


def test_configs_are_shipped():
    assert {"debug_2d", "llama3_8b", "llama70b_2d"} <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_loads_and_says_how_to_launch(path):
    cfg = load_config(path)
    assert cfg.job.name == path.stem
    header = path.read_text().split("\n[", 1)[0]
    assert header.startswith("#") and "torchrun" in header


def test_debug_2d_is_the_4_process_cpu_layout():
    cfg = load_config("debug_2d")
    p, t = cfg.parallelism, cfg.training
    assert (p.dp_shard, p.tp, p.pp, cfg.model.flavor) == (2, 2, 1, "debug")
    assert (t.steps, t.global_batch_size, t.seq_len, cfg.optimizer.lr) == (20, 8, 128, 1e-3)
    assert (cfg.lr_scheduler.warmup_steps, cfg.metrics.log_freq, cfg.job.device) == (2, 1, "cpu")


def test_an_empty_unknown_section_is_still_a_typo(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[paralelism]\n")
    assert "unknown section [paralelism]. Did you mean [parallelism]?" in error(load_config, path)


def test_infinite_learning_rate_is_out_of_range():
    assert "accepted: > 0 and < inf" in error(load_config, None, ["--optimizer.lr=inf"])
