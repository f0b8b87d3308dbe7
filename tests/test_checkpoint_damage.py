"""Damaged storage: resume falls back past a damaged checkpoint to the newest intact one
and says what is wrong with it; a damaged step folder is set aside, not left to block that
step's save forever; a save that fails (a full disk) stops every rank with the reason and
leaves every complete checkpoint intact."""

import json
import shutil

import pytest

from tests.conftest import forked_python, launcher_free_env, one_process, torchrun
from meshtrain.training.checkpoint import complete_checkpoints
from meshtrain.training.checkpoint_reader import damage

pytestmark = pytest.mark.slow  # every test here starts processes

ONE = ("--parallelism.dp_shard=1", "--parallelism.tp=1")


def args(out, steps, *more):
    return ["--config", "debug_2d", *ONE, f"--training.steps={steps}", "--training.seq_len=32",
            f"--job.output_dir={out}", "--job.name=run", "--checkpoint.enable=true", "--checkpoint.interval=2",
            "--lr_scheduler.decay_type=constant", *more]


def train(out, steps, *more):
    return one_process("train.py", *args(out, steps, *more))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run that saved steps 2, 4 and 6, trained once for the module."""
    out = tmp_path_factory.mktemp("damage")
    proc = train(out, 6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "run"


@pytest.fixture
def three(trained, tmp_path):
    """This test's own copy of that run (it damages it and trains on)."""
    shutil.copytree(trained, tmp_path / "run")
    folder = tmp_path / "run" / "checkpoint"
    assert [s for s, _ in complete_checkpoints(folder)] == [2, 4, 6]
    return folder


def newest_shard(folder):
    return next((folder / "step-00000006").glob("*.distcp"))


@pytest.mark.parametrize("harm,said", [
    (lambda f: newest_shard(f).write_bytes(newest_shard(f).read_bytes()[:1000]), "is truncated"),
    (lambda f: (f / "step-00000006" / "meta.json").write_text("{ not json"), "meta.json is not JSON"),
    (lambda f: (f / "step-00000006" / "meta.json").write_text("{}"), "meta.json lacks step"),
    (lambda f: (f / "step-00000006" / ".metadata").unlink(), "no DCP index"),
])
def test_a_damaged_newest_checkpoint_is_skipped_named_and_saved_anew(three, harm, said):
    harm(three)
    proc = train(three.parent.parent, 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed at step 4" in proc.stdout
    assert "step-00000006" in proc.stderr and said in proc.stderr
    # Step 6 was trained again and saved: the damaged folder was set aside, not kept in its way.
    assert [s for s, _ in complete_checkpoints(three)] == [2, 4, 6, 8]
    assert all(damage(p) is None for _, p in complete_checkpoints(three))
    assert len(list(three.glob("step-00000006.damaged-*"))) == 1


def test_evaluating_a_damaged_checkpoint_names_it_in_one_line(three):
    newest_shard(three).write_bytes(newest_shard(three).read_bytes()[:1000])
    proc = forked_python("-m", "meshtrain.cli", "evaluate", str(three / "step-00000006"), "--config", "debug_2d",
                         *ONE, "--training.seq_len=32", "--validation.split=0.05", "--validation.steps=1",
                         env=launcher_free_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step-00000006 could not be read" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_with_no_intact_checkpoint_left_the_run_stops_rather_than_start_over(three):
    for step in (2, 4, 6):
        (three / f"step-{step:08d}" / "meta.json").write_text("garbage")
    proc = train(three.parent.parent, 8)
    assert proc.returncode == 2
    assert "no intact checkpoint" in proc.stderr and "step-00000002" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_full_disk_stops_every_rank_with_the_reason_and_keeps_what_was_saved(tmp_path):
    proc = torchrun("tests/workers/faults.py", "disk_full", "1", "4",
                    *args(tmp_path, 8, "--parallelism.dp_shard=2", "--parallelism.tp=2"), nproc=4, timeout=300)
    assert proc.returncode != 0
    assert "No space left on device" in proc.stderr and "step-00000004" in proc.stderr
    assert 'checkpoint.py", line' not in proc.stderr and 'train.py", line' not in proc.stderr  # ours: one line
    folder = tmp_path / "run" / "checkpoint"
    assert [s for s, _ in complete_checkpoints(folder)] == [2] and damage(folder / "step-00000002") is None
    meta = json.loads((folder / "step-00000002" / "meta.json").read_text())
    assert meta["step"] == 2
