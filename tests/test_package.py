"""meshtrain as a package beside the user's code: one `meshtrain` namespace that a user's own
models.py cannot shadow, one `meshtrain` command, and a wheel that holds every module and
shipped config (installed without the checkout, it trains from an empty folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from meshtrain import cli
from meshtrain.training.launch import failed_exit_code, first_error, split_for_torchrun
from tests.conftest import ROOT

ONE_STEP = ("--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1", "--training.steps=1",
            "--training.seq_len=32")
SHADOWS = ("models", "training", "parallel", "planning", "physics", "train", "cli")  # the commonest names in ML code


def meshtrain_env() -> dict:
    """The environment of a user's shell: no PYTHONPATH pointing into the checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}


def test_a_users_own_models_training_and_parallel_files_do_not_shadow_meshtrain(tmp_path):
    for name in SHADOWS:  # each would end the run if anything imported it
        (tmp_path / f"{name}.py").write_text(f'raise SystemExit("the user\'s own {name}.py was imported")\n')
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "__init__.py").write_text('raise SystemExit("the user\'s training/ was imported")\n')
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", *ONE_STEP, f"--job.output_dir={tmp_path}/out"],
                          cwd=tmp_path, env=meshtrain_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "meshtrain: done: steps 1-1" in proc.stdout


def test_nothing_in_meshtrain_imports_a_bare_top_level_name():
    """`from models import ...` would work in the checkout (the root is on sys.path) and
    break for every user: each import of our own code must be spelled meshtrain.*."""
    import ast

    ours = {"parallel", "models", "training", "planning", "physics", "train", "cli"}
    bad = []
    for path in ROOT.rglob("*.py"):
        if {".venv", ".git", "build"} & set(path.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in ours]
    assert not bad, "bare imports of meshtrain's modules:\n" + "\n".join(bad)


def test_the_meshtrain_command_lists_its_subcommands_and_each_has_help(capsys):
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("train", "plan", "estimate", "dry-run", "check", "prepare-data", "export"):
        assert f"  {name} " in listed, listed
        assert cli.main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: meshtrain {name}"), (name, out[:300])
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_torchrun_options_go_to_torchrun_and_the_rest_to_the_trainer():
    launcher, trainer = split_for_torchrun(["--config", "debug_2d", "--nproc-per-node", "4", "--training.steps=2",
                                            "--max-restarts=1", "--nnodes", "1", "--dry-run"])
    assert launcher == ["--nproc-per-node", "4", "--max-restarts=1", "--nnodes", "1"]
    assert trainer == ["--config", "debug_2d", "--training.steps=2", "--dry-run"]
    assert split_for_torchrun(["--config", "debug_2d"]) == ([], ["--config", "debug_2d"])


def test_the_first_ranks_message_is_said_once():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failure(rank, code, message, timestamp):
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="<none>")
        f.message, f.timestamp = message, timestamp
        return f

    mine = "meshtrain: error: [training] dataset_path: no such folder"
    err = ChildFailedError("meshtrain.train", {
        2: failure(2, -15, "Signal 15 (SIGTERM) received", 5), 1: failure(1, 2, mine, 5),
        0: failure(0, 2, mine, 5), 3: failure(3, 1, "To enable traceback see ...", 6)})
    assert first_error(err) == mine
    killed = ChildFailedError("meshtrain.train", {3: failure(3, -9, "Signal 9 (SIGKILL) received", 4),
                                                  0: failure(0, -15, "Signal 15 (SIGTERM) received", 5)})
    assert first_error(killed) == "meshtrain: error: rank 3 was killed by SIGKILL"
    bug = ChildFailedError("meshtrain.train", {1: failure(1, 1, "To enable traceback see ...", 4)})
    assert "rank 1 exited with code 1 (its traceback is above)" in first_error(bug)
    assert failed_exit_code(err) == 2 and failed_exit_code(killed) == 1 and failed_exit_code(bug) == 1
    # Rank 0 left our message and was then SIGTERMed by torchrun because rank 1 exited 2
    # first, in the same second: rank 0's message is said, rank 1's code returned (seen
    # under load: the launcher exited 1 for a refused dataset folder).
    raced = ChildFailedError("meshtrain.train", {0: failure(0, -15, mine, 5), 1: failure(1, 2, mine, 5)})
    assert first_error(raced) == mine and failed_exit_code(raced) == 2


@pytest.mark.slow
def test_an_error_after_start_up_is_said_once_with_no_torchrun_report(tmp_path):
    """The dataset folder is looked at once ranks run (torch started): 4 ranks find it
    missing, the launcher prints one line and exits 2 -- not ~40 lines of ChildFailedError."""
    proc = subprocess.run([sys.executable, "-m", "meshtrain.cli", "train", "--nproc-per-node", "4",
                           "--config", "debug_2d", f"--job.output_dir={tmp_path}", "--training.dataset=tokens",
                           f"--training.dataset_path={tmp_path}/missing"],
                          cwd=tmp_path, env=meshtrain_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("meshtrain: error: [training] dataset"), proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr, proc.stderr


NOT_INSTALLED = {"tests", "docs", "examples", "bench", "scripts", "build", "dist"}  # the checkout's, not the package's


def listed_packages() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_package_folder_is_installed():
    """A new folder of code left out of pyproject's list works from the checkout and is
    missing from every install: each folder with an __init__.py must be listed."""
    folders = {"meshtrain." + ".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("**/__init__.py")
               if not ({".venv", ".git"} | NOT_INSTALLED) & set(p.relative_to(ROOT).parts)}
    assert folders == set(listed_packages()) - {"meshtrain"}


def wheel_files(out: Path) -> set[str]:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("meshtrain-*.whl")
    return wheel, set(zipfile.ZipFile(wheel).namelist())


@pytest.mark.slow
def test_installed_from_a_wheel_it_trains_from_an_empty_folder(tmp_path):
    """`pip install .`, not editable: every module and shipped config in the wheel, nothing
    under a bare top-level name, and `meshtrain train --nproc-per-node 4` from an empty folder."""
    wheel, files = wheel_files(tmp_path / "dist")
    tracked = subprocess.run(["git", "ls-files", "*.py", "configs"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    tops = {name.split(".")[1] for name in listed_packages() if "." in name} | {"configs"}
    package = [f for f in tracked if f.split("/")[0] in tops or ("/" not in f and f.endswith(".py"))]
    missing = [f for f in package if f"meshtrain/{f}" not in files]
    assert not missing, f"not in the wheel: {missing}"
    installed = {f.split("/")[0] for f in files if not f.startswith("meshtrain-")}
    assert installed == {"meshtrain"}, f"installed top-level names besides meshtrain: {installed - {'meshtrain'}}"

    venv = tmp_path / "venv"  # torch comes from the system site; meshtrain only from the wheel
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = meshtrain_env() | {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["meshtrain", "train", "--config", "debug_2d", "--nproc-per-node", "4",
                           "--training.steps", "2"], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step    2 | loss" in proc.stdout and "meshtrain: done" in proc.stdout, proc.stdout
    assert (empty / "outputs" / "debug_2d" / "tb").is_dir()
    where = subprocess.run([venv / "bin/python", "-c", "import meshtrain.train as t; print(t.__file__)"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout
    assert str(venv) in where, where  # the wheel's copy ran, not the checkout's
    shutil.rmtree(venv)
