import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked_ranks import forked_python, forked_ranks
from tests.in_process import ENV_KEYS

ROOT = Path(__file__).resolve().parent.parent

# One OpenMP thread for torch in the test process and in the processes it starts (torchrun
# ranks already get one): the tests' models are tiny, and two threads on a 2-core machine
# that is busy with anything else spin against each other -- the plain-PyTorch reference of
# test_train.py took 27 s instead of 3 that way.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file: the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The README's command runs the suite on two pytest-xdist workers, a file at a time each
# (`-n 2`; --dist loadfile in pyproject.toml, so a file's shared torchrun job and traces run
# once). A worker takes the next file when it finishes one, so the longest files go first:
# otherwise the run can end with one worker alone on test_parity.py's 8 minutes. The order
# is by serial seconds measured on a 2-core machine (parity 484 s ... plan 108 s); the
# files not named keep their collection order after these.
LONGEST_FIRST = ("test_parity.py", "test_checkpoint.py", "test_train.py", "test_collective_check.py",
                 "test_memory_grid.py", "test_dry_run.py", "test_faults.py", "test_context_parallel.py",
                 "test_validation.py", "test_lora.py", "test_hf_toml.py", "test_reliability.py",
                 "test_examples.py", "test_plan.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest as collected


def torchrun(script: str, *args: str, nproc: int = 4, timeout: int = 300, env: dict | None = None,
             max_restarts: int = 0):
    """Launch a real torchrun job from the repo root; returns the CompletedProcess."""
    # --standalone: the launcher's store binds port 0 itself. A port found free here and
    # handed over could be taken in between (another test's gloo sockets use the same
    # ephemeral range), and the launcher would then connect to a stranger's socket.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}",
           script, *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def launcher_free_env() -> dict:
    """This process's environment without a launcher's rendezvous (an outer job's, or one an
    in-process test set: two runs side by side would both listen on its port), for a
    process that is to be a world of one."""
    return {**{k: v for k, v in os.environ.items() if k not in ENV_KEYS}, "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1"}


def one_process(script: str, *args: str, timeout: int = 300):
    """``script`` as a world of one without torchrun (parallel/mesh.py's init_distributed
    starts the same one-rank process group), forked (tests/forked_ranks.py): neither the
    launcher's start-up nor the interpreter's imports."""
    return forked_python(script, *args, env=launcher_free_env(), timeout=timeout)


def train_layouts(worker: str, out: Path, names, nproc: int) -> dict:
    """One job of ``worker`` trains every named layout in turn (one start-up, not one per
    layout) and saves each result as OUT/NAME.pt; returns them by name. Its ranks are
    forked (tests/forked_ranks.py): what they compute is the proof, not the launcher."""
    import torch

    names = list(names)
    proc = forked_ranks(worker, str(out), *names, nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {name: torch.load(out / f"{name}.pt") for name in names}


def recipe_runs(out: Path, runs: dict, nproc: int, timeout: int = 600) -> dict:
    """One job of tests/workers/recipe_runs.py trains each named `train.py` command line in
    ``runs`` in turn (one start-up, not one per run); returns each result by name. Ranks
    forked, as ``train_layouts``'."""
    import json

    import torch

    (out / "runs.json").write_text(json.dumps(runs))
    proc = forked_ranks("tests/workers/recipe_runs.py", str(out), str(out / "runs.json"), nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {name: torch.load(out / f"{name}.pt") for name in runs}


def dry_run_refusal(*argv: str) -> str:
    """`train.py *argv --dry-run` in this process: it must stop with exit code 2, one
    error line and no traceback, and leave no process group behind. Returns the line."""
    import contextlib
    import io

    import torch.distributed as dist

    from meshtrain import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.run([*argv, "--dry-run"])
    assert not dist.is_initialized(), "a process group was left behind"
    message = err.getvalue().strip()
    assert code == 2 and message.startswith("meshtrain: error: ") and "Traceback" not in message, (code, message)
    return message


@pytest.fixture
def roofline_only(tmp_path, monkeypatch):
    """The planner with no measured kernel table: every GPU's matmuls by the roofline
    (planning/matmul.py), as for a GPU nobody has measured."""
    from meshtrain.planning import matmul

    monkeypatch.setattr(matmul, "TABLES", tmp_path)
    matmul.gemm_seconds.cache_clear()
    yield
    monkeypatch.undo()
    matmul.gemm_seconds.cache_clear()


@pytest.fixture
def fake_world():
    """A fake process group of any size in this one process (no communication happens)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int, rank: int = 0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
