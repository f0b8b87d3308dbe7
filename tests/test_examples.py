"""The examples run as documented, learn, and give the same losses on any layout."""

import re
import shutil

import pytest
import torch

from tests.conftest import ROOT, one_process, torchrun

pytestmark = pytest.mark.slow  # every test here starts processes

def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)", stdout, flags=re.M)]


def run_torchrun(script: str, *args: str) -> list[float]:
    proc = torchrun(script, *args, nproc=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # A rank aborting at exit after its work is done (parallel/mesh.py's shutdown race):
    # every 4-process run here watches for it, beside tests/test_reliability.py's repeats.
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return losses(proc.stdout)


_single_runs: dict[tuple, list[float]] = {}


def run_single(script: str, *args: str) -> list[float]:
    """The one-process losses of ``script *args``, run once for the module (two tests
    compare against each of them)."""
    if (script, *args) not in _single_runs:
        _single_runs[(script, *args)] = _run_single(script, *args)
    return _single_runs[(script, *args)]


def _run_single(script: str, *args: str) -> list[float]:
    proc = one_process(script, *args)  # forked: the reference's numbers, not its interpreter, are the point
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return losses(proc.stdout)


def assert_learns(got: list[float]):
    assert len(got) == 10, got
    assert all(b < a for a, b in zip(got, got[1:])), got


@pytest.mark.parametrize("script", ["examples/compose_2d.py", "examples/custom_model_2d.py"])
def test_dp2_tp2_matches_one_process(script):
    # Same global batch and same initial weights: the 4-rank dp_shard 2 x tp 2 run must
    # print the single-process losses, up to summation order.
    distributed = run_torchrun(script)  # --tp 2 by default
    assert_learns(distributed)
    single = run_single(script, "--tp", "1")
    assert_learns(single)
    torch.testing.assert_close(torch.tensor(distributed), torch.tensor(single), rtol=1e-5, atol=0)


def test_your_own_model_in_pipeline_stages_matches_one_process():
    pipeline = run_torchrun("examples/custom_model_pipeline.py")  # pp 2 x dp_shard 2
    assert_learns(pipeline)
    single = run_single("examples/custom_model_2d.py", "--tp", "1")
    torch.testing.assert_close(torch.tensor(pipeline), torch.tensor(single), rtol=1e-5, atol=0)


def test_pipeline_example_pp2_dp2_matches_one_process():
    pipeline = run_torchrun("examples/compose_3d.py")  # pp 2 x dp_shard 2, 1F1B
    assert_learns(pipeline)
    single = run_single("examples/compose_2d.py", "--tp", "1")
    torch.testing.assert_close(torch.tensor(pipeline), torch.tensor(single), rtol=1e-5, atol=0)


def test_the_readme_python_example_trains_under_torchrun(tmp_path):
    # The README's first python block, as a reader would paste it, plus a print of the loss.
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    script = tmp_path / "readme_example.py"
    shutil.copy(ROOT / "examples" / "custom_model_2d.py", tmp_path)  # "put it beside custom_model_2d.py"
    loop, end = code.split("shutdown_distributed()   #")
    script.write_text(loop + "    if torch.distributed.get_rank() == 0:\n"
                             "        print(f'step {step} loss {loss:.6f}', flush=True)\n"
                      + "shutdown_distributed()   #" + end)
    assert_learns(run_torchrun(str(script)))
