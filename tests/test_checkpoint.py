"""Checkpoints through train.py with real process groups, real DCP files and real deaths:
a resumed run continues bitwise like an uninterrupted one, a checkpoint loads into other
layouts, a kill in the middle of a save damages nothing, and bad checkpoints are refused."""

import shutil
import warnings

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import one_process, torchrun
from tests.forked_ranks import forked_python, forked_ranks
from tests.workers.parity import MUON
from meshtrain.training.checkpoint import complete_checkpoints, step_dir

STEPS = 8
HALF = STEPS // 2  # the checkpoint the resumed runs start from
DP2_TP2 = ("--parallelism.dp_shard=2", "--parallelism.tp=2")
PP2_DP2 = ("--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1")


def args(out, name, *overrides):
    return ["--config", "debug_2d", f"--training.steps={STEPS}", "--training.seq_len=64",
            f"--job.output_dir={out}", f"--job.name={name}", "--checkpoint.enable=true",
            f"--checkpoint.interval={HALF}", *overrides]


def losses(out, name, first=1) -> torch.Tensor:
    """Logged losses of steps first..STEPS, each exactly once (a resumed run purges what
    the interrupted one logged past its checkpoint)."""
    acc = EventAccumulator(str(out / name / "tb"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == list(range(first, STEPS + 1)), [e.step for e in events]
    return torch.tensor([e.value for e in events])


def train(out, name, *overrides, nproc=4):
    proc = forked_ranks("train.py", *args(out, name, *overrides), nproc=nproc, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def crash(out, name, mode, step, *overrides):
    proc = torchrun("tests/workers/crash_in_checkpoint.py", mode, str(step), *args(out, name, *overrides),
                    nproc=4, timeout=300)
    assert proc.returncode != 0, "the job was meant to die"
    return proc


def steps_saved(out, name):
    return [s for s, _ in complete_checkpoints(out / name / "checkpoint")]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def uninterrupted(out):
    """dp 2 x tp 2, 8 steps, saving at 4 and 8 in the background (async), Hugging Face
    folders too (the resumed runs export none: their losses show the export changes nothing)."""
    train(out, "whole", *DP2_TP2, "--checkpoint.async_save=true", f"--checkpoint.export_hf_interval={HALF}")
    return losses(out, "whole")


@pytest.mark.slow
def test_killed_after_a_save_then_rerun_continues_bitwise(out, uninterrupted):
    crash(out, "resumed", "after-save", HALF, *DP2_TP2)
    assert steps_saved(out, "resumed") == [HALF]
    proc = train(out, "resumed", *DP2_TP2)  # the same command again
    assert f"resumed at step {HALF}" in proc.stdout
    assert torch.equal(losses(out, "resumed"), uninterrupted)
    assert steps_saved(out, "resumed") == [HALF, STEPS]


@pytest.mark.slow
def test_hugging_face_folders_gathered_from_dp2_tp2_shards_give_that_steps_logits_in_transformers(out, uninterrupted):
    pytest.importorskip("transformers")
    from tests.test_hf_export_during_training import assert_transformers_gives_the_logits_of

    hf = out / "whole" / "hf"
    assert sorted(hf.iterdir()) == [step_dir(hf, HALF), step_dir(hf, STEPS)]  # nothing half-written
    for step in (HALF, STEPS):
        assert_transformers_gives_the_logits_of(step_dir(hf, step), step_dir(out / "whole" / "checkpoint", step))


@pytest.mark.slow
def test_pipeline_run_killed_mid_save_resumes_from_the_previous_checkpoint_bitwise(out):
    keep = ("--checkpoint.interval=2", "--checkpoint.keep_latest_k=2")
    crash(out, "pp_killed", "mid-save", STEPS, *PP2_DP2, *keep)
    # The last step's loss is logged before its save, so the killed job's log is already the whole
    # uninterrupted run (losses() checks each step is there once): the rerun must match it.
    whole = losses(out, "pp_killed")
    folder = out / "pp_killed" / "checkpoint"
    partial = step_dir(folder, STEPS).with_suffix(".tmp")
    assert partial.is_dir()  # rank 1's shard got written ...
    assert not (partial / ".metadata").exists()  # ... the save never finished
    assert steps_saved(out, "pp_killed") == [4, 6]  # nothing older was damaged; step 2 pruned
    proc = train(out, "pp_killed", *PP2_DP2, *keep)
    assert "resumed at step 6" in proc.stdout
    assert torch.equal(losses(out, "pp_killed"), whole)
    assert steps_saved(out, "pp_killed") == [6, 8]  # step 4 pruned
    assert not partial.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [("fsdp4", ("--parallelism.dp_shard=4", "--parallelism.tp=1")),
                                         ("pp2_dp2", PP2_DP2)])
def test_checkpoint_of_dp2_tp2_resumes_under_another_layout(out, uninterrupted, name, layout):
    src = step_dir(out / "whole" / "checkpoint", HALF)
    dst = step_dir(out / f"reshard_{name}" / "checkpoint", HALF)
    shutil.copytree(src, dst)
    proc = train(out, f"reshard_{name}", *layout)
    assert f"resumed at step {HALF}" in proc.stdout
    got = losses(out, f"reshard_{name}", first=HALF + 1)
    torch.testing.assert_close(got, uninterrupted[HALF:], rtol=1e-4, atol=0)


def _train_cli(*argv):
    return forked_python("train.py", *argv, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": ""})


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_with_the_difference(out, uninterrupted):
    shutil.copytree(step_dir(out / "whole" / "checkpoint", HALF),
                    step_dir(out / "other" / "checkpoint", HALF))
    proc = _train_cli(*args(out, "other", "--parallelism.dp_shard=1", "--parallelism.tp=1",
                           "--model.vocab_size=384"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is of another model (vocab_size: checkpoint 320 vs this run 384)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_incomplete_and_half_written_folders_are_not_checkpoints(tmp_path):
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-00000003" / "meta.json").write_text("{}")
    (tmp_path / "step-00000006.tmp").mkdir()  # a save that died
    (tmp_path / "step-00000009").mkdir()      # damaged: no metadata
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [s for s, _ in complete_checkpoints(tmp_path)] == [3]
    assert any("step-00000009" in str(w.message) for w in caught)


@pytest.mark.slow
def test_training_starts_from_a_hugging_face_folder(tmp_path):
    """Fine-tuning a released model: the first loss is that of the Hugging Face weights."""
    from meshtrain.models.llama.hf import save_hf
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import load_config
    from meshtrain.training.data import build_dataloader, build_tokenizer
    from meshtrain.training.step import cross_entropy

    cfg = load_config("debug_2d", args(tmp_path, "hf", "--parallelism.dp_shard=1", "--parallelism.tp=1")[2:])
    model = recipe.build_model(cfg, build_tokenizer("byte").vocab_size)
    model.init_weights(seed=5)  # not the run's seed 0: the loss shows which weights were used
    save_hf(((n, p.detach()) for n, p in model.named_parameters()), model.cfg, tmp_path / "hf_model")
    data, _ = build_dataloader(cfg.training, dp_rank=0, dp_size=1)
    with torch.no_grad():
        want = sum(cross_entropy(model(x), y).item() for x, y in data.batch(0))

    proc = _train_cli(*args(tmp_path, "hf", "--parallelism.dp_shard=1", "--parallelism.tp=1",
                           "--training.steps=1", f"--checkpoint.initial_load_hf={tmp_path / 'hf_model'}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = EventAccumulator(str(tmp_path / "hf" / "tb"))
    acc.Reload()
    assert acc.Scalars("loss")[0].value == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_a_missing_hugging_face_folder_is_a_config_error(tmp_path):
    proc = _train_cli(*args(tmp_path, "nohf", "--parallelism.dp_shard=1", "--parallelism.tp=1",
                           f"--checkpoint.initial_load_hf={tmp_path / 'absent'}"))
    assert proc.returncode == 2
    assert "initial_load_hf" in proc.stderr and "config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_checkpoint_of_another_experiment_is_refused_unless_told_to_resume(out, uninterrupted):
    shutil.copytree(step_dir(out / "whole" / "checkpoint", HALF),
                    step_dir(out / "differs" / "checkpoint", HALF))
    one = ("--parallelism.dp_shard=1", "--parallelism.tp=1")  # a new layout is fine ...
    proc = _train_cli(*args(out, "differs", *one, "--optimizer.lr=0.5"))  # ... another lr is not
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "was written by a run with another config ([optimizer] lr: 0.001 then, 0.5 now)" in proc.stderr
    proc = _train_cli(*args(out, "differs", *one, "--optimizer.lr=0.5", "--checkpoint.if_config_differs=resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed at step {HALF}" in proc.stdout


def test_a_key_the_schema_gained_or_lost_since_the_save_is_no_difference():
    """A checkpoint written before [model] n_layers existed (and with [job] debug, since
    removed) resumes; a real change of setting is still named."""
    from meshtrain.training.resume_compat import config_differences
    from meshtrain.training.config_loader import config_to_toml, load_config

    now = config_to_toml(load_config("debug_2d"))
    then = now.replace("n_layers = 0\n", "").replace("[job]\n", "[job]\ndebug = false\n")
    assert then != now and config_differences(then, now) == []
    assert config_differences(then.replace("lr = 0.001", "lr = 0.002"), now) == [
        "[optimizer] lr: 0.002 then, 0.001 now"]



@pytest.mark.slow
def test_muon_state_resumes_bitwise_and_under_another_layout(out):
    """[optimizer] name = "Muon": its momentum (sharded like the weights) and AdamW's moments
    are saved and loaded with DCP; a copy of step 4 resumes under dp 2 x tp 2 bitwise and
    under fsdp 2 on 2 ranks within rounding (another layout sums in another order)."""
    muon = [f"--{'optimizer.name' if key == 'optimizer' else 'model.' + key}={value}" for key, value in MUON.items()]
    train(out, "muon_whole", *DP2_TP2, *muon)
    whole = losses(out, "muon_whole")
    for name, layout, nproc in (("muon_resumed", DP2_TP2, 4),
                                ("muon_fsdp2", ("--parallelism.dp_shard=2", "--parallelism.tp=1"), 2)):
        shutil.copytree(step_dir(out / "muon_whole" / "checkpoint", HALF),
                        step_dir(out / name / "checkpoint", HALF))
        assert f"resumed at step {HALF}" in train(out, name, *layout, *muon, nproc=nproc).stdout
    assert torch.equal(losses(out, "muon_resumed", first=HALF + 1), whole[HALF:])
    torch.testing.assert_close(losses(out, "muon_fsdp2", first=HALF + 1), whole[HALF:], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_a_checkpoint_of_adamw_is_refused_by_muon_even_when_told_to_resume(tmp_path):
    """AdamW's moments are not Muon's momentum: one line that says so, not a damaged-checkpoint story."""
    one = ["--parallelism.dp_shard=1", "--parallelism.tp=1", "--checkpoint.interval=2"]
    first = one_process("train.py", *args(tmp_path, "switch", *one, "--training.steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    proc = one_process("train.py", *args(tmp_path, "switch", *one, "--optimizer.name=Muon",
                                         "--checkpoint.if_config_differs=resume"))
    assert proc.returncode != 0
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert 'holds the state of [optimizer] name = "AdamW", and this run\'s name = "Muon"' in error[0]
