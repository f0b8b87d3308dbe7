"""The planner's float8 (planning/kernels.py FLOAT8_MATMUL_SPEEDUP): the blocks' Linear
matmuls run faster by the recipe's stated factor; attention, element-wise work and the
output layer stay bf16. Applying the factor to the whole step, or to nothing, fails these."""

import dataclasses

import pytest

from meshtrain.parallel import ParallelDims
from meshtrain.physics.gpus import get_gpu
from meshtrain.planning.estimate import estimate
from meshtrain.planning.kernels import FLOAT8_MATMUL_SPEEDUP, block_seconds, head_seconds
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import Job

H100 = get_gpu("h100-80gb")


@pytest.mark.parametrize("recipe", list(FLOAT8_MATMUL_SPEEDUP))
def test_float8_moves_the_estimate_by_its_factor_on_the_block_matmuls_only(recipe):
    shape = resolve_model("8B", n_layers=4)
    bf16 = Job(shape, H100, 1, 8, 4096, 16, compiled=True)
    f8 = dataclasses.replace(bf16, float8=recipe)
    lay = ParallelDims(world_size=8, dp_shard=4, tp=2, ac="op", micro_batch=1)
    a, b = estimate(bf16, lay), estimate(f8, lay)
    # The output layer's matmul (head_seconds) is not a float8 Linear: it keeps its time.
    n_mb = 16 // 4
    head = head_seconds(shape, tokens=4096, tp=2, gpu=H100).matmul * n_mb
    factor = FLOAT8_MATMUL_SPEEDUP[recipe]
    assert b.compute_split["matmul"] == pytest.approx((a.compute_split["matmul"] - head) / factor + head, rel=1e-12)
    assert b.compute_split["attention"] == a.compute_split["attention"]
    assert b.compute_split["memory"] == a.compute_split["memory"]
    assert a.step_time - b.step_time == pytest.approx(a.compute_split["matmul"] - b.compute_split["matmul"], rel=1e-9)


def test_the_tensorwise_factor_gives_the_measured_speedup_at_the_benchmarks_shape():
    """docs/benchmarks.md: 10 Llama-3-8B blocks, seq 8192, one sequence, compiled, op-level
    AC, one H100: float8 tensorwise 1.16x bf16 tokens/s, rowwise 1.00x."""
    m = resolve_model("8B")
    run = lambda recipe: (10 * block_seconds(m, tokens=8192, seq=8192, tp=1, cp=1, gpu=H100, recompute="op",
                                             compiled=True, float8=recipe).total
                          + head_seconds(m, tokens=8192, tp=1, gpu=H100).total)
    assert run("") / run("tensorwise") == pytest.approx(1.16, abs=0.005)
    assert run("") / run("rowwise") == pytest.approx(1.00, abs=0.005)
