"""Where checkpoints go, checked before the first step: a checkpoint or run folder that is
a link to nothing (an unmounted disk) is refused naming it (before: the run trained from
step 0 and died at its first save), and a checkpoint folder another live run saves into
is refused naming that run (before: both ran, interleaving and pruning each other's
checkpoints)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from tests.in_process import refused, tiny_run, train_in_process
from meshtrain.training.run_lock import LOCK_NAME


@pytest.mark.parametrize("link,key", [("run/checkpoint", "[checkpoint] folder"), ("run", "[job] output_dir / name")])
def test_a_folder_that_is_a_link_to_nothing_is_refused_before_the_first_step(tmp_path, link, key):
    path = tmp_path / link
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(tmp_path / "unmounted" / "scratch")
    result = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=1"))
    message = refused(result)
    assert key in message and f'"{path}" is a link to "{tmp_path / "unmounted" / "scratch"}"' in message, message
    assert "step    1" not in result.stdout


def test_a_checkpoint_folder_another_live_run_saves_into_is_refused_naming_it(tmp_path):
    shared = tmp_path / "shared_checkpoints"
    shared.mkdir()
    other = {"host": socket.gethostname(), "pid": os.getppid(), "started": time.time() - 60,  # alive: our parent
             "run_dir": str(tmp_path / "other_run")}
    (shared / LOCK_NAME).write_text(json.dumps(other))
    result = train_in_process(*tiny_run(tmp_path, "this_run", "--training.steps=1", f"--checkpoint.folder={shared}"))
    message = refused(result)
    assert f"[checkpoint] folder = {shared} is in use by the run in {tmp_path / 'other_run'}" in message, message
    assert f"pid {os.getppid()}" in message and "step    1" not in result.stdout
    assert not list(shared.glob("step-*"))


def test_a_run_holds_its_checkpoint_folder_and_takes_over_a_dead_runs_lock(tmp_path):
    shared = tmp_path / "shared_checkpoints"
    shared.mkdir()
    (shared / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1,  # no such pid
                                                "started": time.time() - 60, "run_dir": "gone"}))
    result = train_in_process(*tiny_run(tmp_path, "this_run", "--training.steps=1", f"--checkpoint.folder={shared}"))
    assert result.code == 0, result.stderr[-2000:]
    holder = json.loads((shared / LOCK_NAME).read_text())  # released at exit, still held in this process
    assert holder["pid"] == os.getpid() and holder["run_dir"] == str(tmp_path / "this_run")
    assert [p.name for p in shared.glob("step-*")] == ["step-00000001"]
