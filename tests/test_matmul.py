"""Compute speed per matmul shape (planning/matmul.py): the roofline's asymptote is the
measured 8192^3 rate, a tile count one over the SMs takes two waves, a 2,048-wide model's
matmuls run below an 8,192-wide one's, each Linear is timed at its own three shapes, and
a measured kernel_speeds table replaces the roofline for its GPU. Timing every matmul at one
speed (the model this replaced) fails the first three."""

import json

import pytest

from meshtrain.models.gpt2.model import GPT2
from meshtrain.physics.gpus import get_gpu
from meshtrain.planning import matmul
from meshtrain.planning.kernels import block_linears, block_matmul_seconds
from meshtrain.planning.matmul import gemm_seconds, load_matmul_table, measured_tables, roofline_seconds, table_rate
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import ModelShape

H100 = get_gpu("h100-80gb")
rate = lambda m, k, n, gpu=H100: 2 * m * k * n / roofline_seconds(m, k, n, gpu)


def gpt(dim: int, heads: int) -> ModelShape:
    """A GPT block (4h GeLU MLP, multi-head) of width ``dim``."""
    m = GPT2.from_flavor("124M", meta=True, dim=dim, n_heads=heads, n_layers=1, vocab_size=32_768, max_seq_len=4096)
    return ModelShape.from_model(m, flavor=f"gpt-{dim}", n_layers=1, family="gpt2", learned_positions=True)


@pytest.mark.parametrize("name", ["h100-80gb", "h200-141gb", "a100-80gb", "b200"])
def test_the_8192_cube_runs_at_the_measured_large_matmul_rate(name):
    gpu = get_gpu(name)
    assert rate(8192, 8192, 8192, gpu) == pytest.approx(gpu.peak_bf16_flops * gpu.matmul_efficiency, rel=1e-9)


def test_one_tile_more_than_the_sms_takes_two_waves():
    # 896 x 4608 is 7 x 18 = 126 tiles of 128 x 256: one wave on 132 SMs; 896 x 4864 is
    # 7 x 19 = 133: a second wave for one tile, nearly twice the time for 6% more FLOPs.
    # K long enough that both are compute-bound.
    assert H100.sms == 132
    one, two = roofline_seconds(896, 16384, 4608, H100), roofline_seconds(896, 16384, 4864, H100)
    assert two / one > 1.8
    assert rate(896, 16384, 4864) < 0.55 * rate(896, 16384, 4608)


def test_a_2048_wide_models_matmuls_run_below_an_8192_wide_ones(roofline_only):
    # The same 16,384 tokens through one block at TP 1, by the roofline: a short K loop
    # pays its tiles' epilogue on less math (planning/matmul.py).
    speed = lambda m: 6 * m.layer_split * 16384 / sum(block_matmul_seconds(m, 16384, 1, H100))
    small, large = speed(gpt(2048, 16)), speed(gpt(8192, 64))
    assert small < 0.97 * large, (small / 1e12, large / 1e12)
    assert rate(16384, 2048, 2048) < 0.95 * H100.achievable_flops


@pytest.mark.parametrize("model", [resolve_model("8B", n_layers=1), gpt(2048, 16)], ids=["llama-8B", "gpt-2048"])
def test_each_linear_runs_its_forward_and_both_backward_matmuls_at_its_own_shape(model):
    assert sum(i * o for i, o in block_linears(model, 1)) == model.layer_split  # every weight, none twice
    tokens, tp = 8192, 4
    fwd, bwd = block_matmul_seconds(model, tokens, tp, H100)
    shapes = block_linears(model, tp)
    assert fwd == pytest.approx(sum(gemm_seconds(tokens, i, o, H100) for i, o in shapes), rel=1e-12)
    assert bwd == pytest.approx(sum(gemm_seconds(tokens, o, i, H100) + gemm_seconds(i, tokens, o, H100)
                                    for i, o in shapes), rel=1e-12)
    # TP splits the column-parallel outputs and the row-parallel inputs: 1 / tp of the weights.
    assert sum(i * o for i, o in shapes) == model.layer_split // tp


@pytest.mark.parametrize("file, device, name", [("h100.json", "NVIDIA H100 80GB HBM3", "h100-80gb"),
                                                ("h200.json", "NVIDIA H200", "h200-141gb")])
def test_a_shipped_table_is_what_the_planner_times_its_gpu_by(file, device, name):
    """physics/kernels/, bench/kernel_speeds.py's runs on an H100 80GB HBM3 and an H200: a
    shape it measured is timed at its measured rate, whatever the roofline says."""
    measured = json.loads((matmul.TABLES / file).read_text())
    assert measured["device"] == device and not measured["quick"]
    gpu = get_gpu(name)
    gemm_seconds.cache_clear()
    for row in measured["matmul"]:
        m, k, n = row["m"], row["k"], row["n"]
        assert 2 * m * k * n / gemm_seconds(m, k, n, gpu) == pytest.approx(row["tflops"] * 1e12, rel=1e-12)


@pytest.mark.parametrize("file, name", [("h100.json", "h100-80gb"), ("h200.json", "h200-141gb")])
def test_a_shape_left_out_of_a_shipped_table_is_predicted_from_the_rest_within_5_percent(file, name):
    """Each measured shape left out in turn and timed from the other rows: the median
    error is what the planner makes on a shape nobody measured (H100: the roofline alone
    23%; the same weights on the rates instead of the ratios to the roofline 7%)."""
    _, rows = load_matmul_table(matmul.TABLES / file)
    gpu = get_gpu(name)
    errors = sorted(abs(table_rate(rows[:i] + rows[i + 1:], *row[:3], gpu) / row[3] - 1)
                    for i, row in enumerate(rows))
    assert errors[len(errors) // 2] < 0.05, errors[len(errors) // 2]


def kernel_speeds_json(path, rows, device="NVIDIA H100 80GB HBM3", quick=False):
    """A table as bench/kernel_speeds.py writes it (only the keys the planner reads differ
    from a real run's by their numbers)."""
    path.write_text(json.dumps({"device": device, "torch": "2.11", "quick": quick,
                                "matmul": [{"m": m, "k": k, "n": n, "tflops": t} for m, k, n, t in rows],
                                "attention": [], "memory": {}}))


def test_a_measured_table_replaces_the_roofline_for_its_gpu(tmp_path, monkeypatch):
    rows = [(1024, 4096, 4096, 100.0), (4096, 4096, 4096, 400.0)]
    kernel_speeds_json(tmp_path / "kernels_h100.json", rows)
    kernel_speeds_json(tmp_path / "kernels_smoke.json", rows, quick=True)      # a --quick run: ignored
    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))            # another bench's JSON: ignored
    assert load_matmul_table(tmp_path / "kernels_smoke.json") is None
    assert measured_tables(tmp_path) == {H100.name: tuple((m, k, n, t * 1e12) for m, k, n, t in rows)}
    table = measured_tables(tmp_path)[H100.name]
    # A measured shape: its own rate; halfway (in log space) between two: the roofline's
    # rate there times the geometric mean of the two measured / roofline ratios.
    assert table_rate(table, 4096, 4096, 4096, H100) == 400e12
    ratios = [t * 1e12 / rate(m, k, n) for m, k, n, t in rows]
    assert table_rate(table, 2048, 4096, 4096, H100) == pytest.approx(
        rate(2048, 4096, 4096) * (ratios[0] * ratios[1]) ** 0.5, rel=1e-12)
    # The planner's matmul time uses it for that GPU, the roofline for the others.
    monkeypatch.setattr(matmul, "TABLES", tmp_path)
    gemm_seconds.cache_clear()
    try:
        assert gemm_seconds(4096, 4096, 4096, H100) == pytest.approx(2 * 4096**3 / 400e12, rel=1e-12)
        h200 = get_gpu("h200-141gb")
        assert gemm_seconds(4096, 4096, 4096, h200) == roofline_seconds(4096, 4096, 4096, h200)
    finally:
        monkeypatch.undo()
        gemm_seconds.cache_clear()
