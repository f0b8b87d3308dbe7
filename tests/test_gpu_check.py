"""`python -m bench.gpu_check` in its CPU mode, end to end, so the GPU command does not rot
between the times a GPU is at hand: train.py checks, throughput rows next to the
hand-written baseline, dry-run predictions, and the JSON shape results are compared by."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # every test here starts processes


def test_cpu_mode_runs_every_section_and_writes_the_documented_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path), "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not result["errors"], result["errors"]
    for key in ("device", "torch", "date", "matmul_tflops", "runs", "memory", "checks"):
        assert key in result
    checks = result["checks"]
    assert checks["learns"] and checks["resume_bitwise"] and checks["bf16_close"], checks
    assert checks["losses_resumed"] == checks["losses_fp32"][checks["resumed_at"]:]
    assert [r["name"] for r in result["runs"]] == ["eager ac=none", "eager ac=op", "eager ac=full"]
    for run in result["runs"]:
        for key in ("name", "tokens_per_second", "tflops", "mfu_spec", "mfu_matmul", "peak_mem_gib",
                    "baseline_tokens_per_second", "ratio"):
            assert key in run, (run["name"], key)
        assert run["tokens_per_second"] > 0 and run["baseline_tokens_per_second"] > 0
        # Same initial weights, same batch, same math: the hand-written loop lands on our loss.
        assert abs(run["loss"] - run["baseline_loss"]) < 1e-3 * abs(run["baseline_loss"]), run
    predicted = {m["name"]: m["predicted_gib"] for m in result["memory"]}
    assert set(predicted) == {"eager ac=none", "eager ac=op", "eager ac=full"}
    # Recomputing more keeps less: the dry run sees the modes' different activations.
    assert predicted["eager ac=none"] > predicted["eager ac=op"] > predicted["eager ac=full"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert "ours / baseline" in table and "predicted GiB" in table
    masking = result["document_masking"]  # bench/document_masking.py's rows: causal vs masked step
    assert masking and all(r["causal_tokens_per_second"] > 0 and r["masked_tokens_per_second"] > 0 for r in masking)
    assert "masked / causal" in table



def test_kernel_speeds_cpu_smoke_run_writes_every_section(tmp_path):
    """`python -m bench.kernel_speeds` (the planner's matmul, attention and memory speeds,
    measured on a GPU) in its CPU smoke mode, so the GPU command does not rot."""
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, "-m", "bench.kernel_speeds", "--device", "cpu", "--quick",
                           "--repeats", "2", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["matmul"][0]["tflops"] > 0 and result["attention"][0]["tflops"] > 0
    assert result["memory"]["copy_gbs"] > 0 and "rmsnorm_eager_gbs_as_counted" in result["memory"]
    assert result["memory"]["rotary_eager_s"] > 0 and result["memory"]["rotary_eager_bytes_per_element"] > 0
    assert "rotary (eager, forward + backward)" in proc.stdout
    assert "attention seq 128" in proc.stdout
    # The planner reads what it writes (planning/matmul.py): not a smoke run's numbers, but
    # the same file as a GPU's run would be.
    from meshtrain.planning.matmul import load_matmul_table

    assert load_matmul_table(out) is None  # --quick
    out.write_text(json.dumps({**result, "quick": False, "device": "NVIDIA H100 80GB HBM3"}))
    assert load_matmul_table(out) == ("NVIDIA H100 80GB HBM3", ((256, 256, 256, result["matmul"][0]["tflops"] * 1e12),))
