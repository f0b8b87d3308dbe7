"""Reliability, the second round: one run per folder (a second job is refused at once, a
dead run's lock taken over), paths and values refused before the run starts instead of
failing after it, binary data refused, a bad config refused before torch is even
imported, reruns that repeat bitwise, and a clean shutdown every time."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, launcher_free_env, one_process, torchrun
from meshtrain.training.run_lock import LOCK_NAME

pytestmark = pytest.mark.slow  # every test here starts processes

ONE = ("--config", "debug_2d", "--parallelism.dp_shard=1", "--parallelism.tp=1", "--training.seq_len=32")


def train(*args):
    return one_process("train.py", *ONE, *args)


def test_a_second_job_on_the_same_folder_is_refused_and_the_first_goes_on(tmp_path):
    out = f"--job.output_dir={tmp_path}"
    first = subprocess.Popen([sys.executable, "train.py", *ONE, out, "--training.steps=400"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launcher_free_env())
    lock = tmp_path / "debug_2d" / LOCK_NAME
    while not lock.exists() and first.poll() is None:
        time.sleep(0.1)
    second = train(out, "--training.steps=2")
    assert second.returncode == 2, second.stderr
    assert "is in use by another run" in second.stderr and f"pid {first.pid}" in second.stderr
    assert "Traceback" not in second.stderr
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    assert not lock.exists()  # released at exit


def test_the_lock_of_a_run_that_died_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "debug_2d").mkdir()
    (tmp_path / "debug_2d" / LOCK_NAME).write_text(json.dumps(
        {"host": os.uname().nodename, "pid": int(dead.stdout), "started": time.time() - 60}))
    proc = train(f"--job.output_dir={tmp_path}", "--training.steps=1")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("blocker,key", [("out", "[job] output_dir"), ("out/debug_2d/checkpoint", "[checkpoint] folder")])
def test_a_file_where_the_run_writes_a_folder_is_refused_before_the_first_step(tmp_path, blocker, key):
    path = tmp_path / blocker
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a folder")
    proc = train(f"--job.output_dir={tmp_path / 'out'}", "--checkpoint.enable=true", "--training.steps=1")
    assert proc.returncode == 2 and key in proc.stderr and str(path) in proc.stderr, proc.stderr[-2000:]
    assert "step    1" not in proc.stdout


def test_a_broken_hugging_face_config_is_named(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{ truncated")
    proc = train(f"--job.output_dir={tmp_path}", f"--checkpoint.initial_load_hf={tmp_path / 'hf'}")
    assert proc.returncode == 2 and str(tmp_path / "hf" / "config.json") in proc.stderr and "not JSON" in proc.stderr


@pytest.mark.parametrize("flag", ["--training.steps=100000000000000000000", "--training.seq_len=2097152"])
def test_values_the_code_cannot_run_are_refused_by_the_schema(tmp_path, flag):
    proc = train(f"--job.output_dir={tmp_path}", flag)
    assert proc.returncode == 2 and "out of range" in proc.stderr and "Traceback" not in proc.stderr


def test_a_binary_file_in_the_dataset_is_refused_naming_it(tmp_path):
    blob = tmp_path / "data" / "weights.txt"
    blob.parent.mkdir()
    blob.write_bytes(torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    proc = train(f"--job.output_dir={tmp_path}", "--training.dataset=text", f"--training.dataset_path={blob.parent}")
    assert proc.returncode == 2 and str(blob) in proc.stderr and "not UTF-8" in proc.stderr


def test_a_bad_config_is_refused_before_torch_is_imported():
    code = ("import sys\nfrom meshtrain import train\n"
            "rc = train.run(['--config', 'debug_2d', '--training.steps', 'ten'])\n"
            "assert rc == 2, rc\n"
            "assert 'torch' not in sys.modules, 'torch was imported to refuse a typo'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=launcher_free_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "must be an integer" in proc.stderr


def test_two_identical_runs_save_the_same_rng_state(tmp_path):
    """torch's global generator is seeded from [training] seed: a rerun repeats bitwise,
    its saved state included."""
    from torch.distributed.checkpoint import load

    from meshtrain.training.checkpoint_reader import SafeReader

    states = []
    for name in ("a", "b"):
        proc = train(f"--job.output_dir={tmp_path}", f"--job.name={name}", "--training.steps=2",
                     "--checkpoint.enable=true", "--checkpoint.interval=2")
        assert proc.returncode == 0, proc.stderr[-2000:]
        state = {"rng": {"cpu": torch.empty_like(torch.get_rng_state())}}
        load(state, storage_reader=SafeReader(str(tmp_path / name / "checkpoint" / "step-00000002")), no_dist=True)
        states.append(state["rng"]["cpu"])
    assert torch.equal(*states)


def test_a_four_process_job_shuts_down_cleanly_every_time():
    """One run in about eight used to end with a rank aborting at exit ("terminate called
    without an active exception") after all its work was done. Three repeats here, and
    every 4-process run of tests/test_examples.py checks for it too (six runs in all)."""
    for attempt in range(3):
        proc = torchrun("examples/custom_model_2d.py", nproc=4)
        assert proc.returncode == 0, f"attempt {attempt}: {proc.stderr[-2000:]}"
        assert "terminate called" not in proc.stderr
