"""Attention's speed by sequence length (planning/kernels.py attention_rate): the planner
times a block's attention at the rate bench/kernel_speeds.py measured for its GPU at that
length, between two measured lengths linearly in log(length), beyond them at the nearest
one's; a GPU nobody measured at its published `attention_efficiency`; a job that names
another kernel's speed (Job.attention_efficiency) at that. Timing attention at one flat
efficiency (the model this replaced) fails the first test; ignoring the job's speed, the last."""

import dataclasses
import json
import math

import pytest

from meshtrain.parallel import ParallelDims
from meshtrain.physics.gpus import get_gpu
from meshtrain.planning import matmul
from meshtrain.planning.estimate import estimate
from meshtrain.planning.kernels import (FA_BACKWARD, attention_rate, block_seconds, load_attention_table,
                                        measured_attention)
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import Job

H100, A100 = get_gpu("h100-80gb"), get_gpu("a100-80gb")
SHAPE = resolve_model("8B", n_layers=1)


def attention_seconds(seq: int, gpu=H100, **kw) -> float:
    """One block's attention over one sequence of ``seq``, forward and backward."""
    return block_seconds(SHAPE, tokens=seq, seq=seq, tp=1, cp=1, gpu=gpu, recompute="none", **kw).attention


def flops(seq: int) -> float:
    """The FLOPs planning/kernels.py counts for that: 4 s^2 d per head forward, halved by the
    causal mask, and the backward's 2.5x."""
    return 4 * seq * seq * SHAPE.dim / 2 * (1 + FA_BACKWARD)


def test_the_shipped_h100_table_times_each_measured_length_at_its_own_rate():
    _, rows = load_attention_table(matmul.TABLES / "h100.json")
    assert [s for s, _ in rows] == [1024, 2048, 4096, 8192, 16384]
    for seq, rate in rows:
        assert attention_seconds(seq) == pytest.approx(flops(seq) / rate, rel=1e-12)
    # The measured kernel is several times faster per FLOP at 16K than at 1K: no one
    # efficiency times both within 15%.
    assert rows[-1][1] / rows[0][1] > 2


def test_between_measured_lengths_linear_in_log_length_and_beyond_them_the_nearest(tmp_path, monkeypatch):
    (tmp_path / "h100.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "quick": False,
        "matmul": [{"m": 8192, "k": 8192, "n": 8192, "tflops": 750.0}],
        "attention": [{"seq": 4096, "batch": 4, "tflops": 400.0}, {"seq": 1024, "batch": 16, "tflops": 200.0}],
        "memory": {}}))
    monkeypatch.setattr(matmul, "TABLES", tmp_path)
    assert measured_attention(tmp_path) == {H100.name: ((1024, 200e12), (4096, 400e12))}
    assert attention_rate(2048, H100) == pytest.approx(300e12, rel=1e-12)  # halfway in log(length)
    assert attention_rate(3000, H100) == pytest.approx(200e12 + 200e12 * math.log(3000 / 1024) / math.log(4), rel=1e-12)
    assert attention_rate(512, H100) == 200e12 and attention_rate(131072, H100) == 400e12
    assert attention_rate(2048, A100) == A100.peak_bf16_flops * A100.attention_efficiency  # not measured


def test_a_gpu_without_a_table_runs_at_its_published_efficiency(roofline_only):
    for seq in (1024, 8192):
        assert attention_seconds(seq) == pytest.approx(flops(seq) / (0.35 * H100.peak_bf16_flops), rel=1e-12)


def test_a_job_that_names_its_kernels_speed_is_timed_at_it():
    job = Job(resolve_model("8B", n_layers=4), H100, 1, 8, 8192, 8)
    lay = ParallelDims(world_size=8, dp_shard=8, ac="none", micro_batch=1)
    measured = estimate(job, lay).compute_split["attention"]
    named = estimate(dataclasses.replace(job, attention_efficiency=0.25), lay).compute_split["attention"]
    assert named == pytest.approx(measured * attention_rate(8192, H100) / (0.25 * H100.peak_bf16_flops), rel=1e-12)
