"""Time of one matmul (m x k) @ (k x n) on one GPU, by its shape.

    seconds = gemm_seconds(16384, 4096, 14336, gpu)

A measured table when the project has one for this GPU (a `bench.kernel_speeds` JSON in
physics/kernels/, shipped with the package: a measured shape's own rate, between them the
roofline corrected by the nearest measured shapes' measured / roofline ratio,
`table_rate`), else a roofline with the GPU's measured large-matmul rate as its asymptote:

    time = max(compute + epilogue, memory) + KERNEL_GAP

- **compute**: cuBLAS / CUTLASS split C (m x n) into output tiles, one per thread block, and
  run them in *waves* of one tile per SM; a partial last wave takes as long as a full one
  (tile and wave quantization: NVIDIA, "Matrix Multiplication Background User's Guide",
  docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication, sections
  "Tile Quantization" and "Wave Quantization"). So time = waves x one wave's time, where a
  wave of full tiles runs at the rate that makes the 8192^3 matmul take what
  physics/gpus.py measured (`matmul_efficiency`): that shape is the asymptote, and a shape
  whose tiles fill every wave runs at it.
- **epilogue**: each tile writes its C block (bf16) once its K loop is done; in a
  non-persistent or "cooperative" kernel (CUTLASS's Hopper schedule with both consumer
  warp groups on one tile) that write is not overlapped with math; a "ping-pong" kernel
  overlaps one warp group's epilogue with the other's math (PyTorch blog, "Deep Dive on
  CUTLASS Ping-Pong GEMM Kernel", 2024). Which one cuBLAS runs is its heuristic's choice:
  we assume cooperative. All tiles' C at the copy bandwidth:
  with the asymptote fixed by the 8192^3 measurement, this is what makes a short K loop
  (a 2,048-wide model's matmuls) slower than a long one.
- **memory**: the bytes of A, B and C (bf16) at the GPU's measured copy bandwidth.
- **KERNEL_GAP**: what each kernel adds between back-to-back launches.

Not modelled: split-K / stream-K (which cuBLAS uses when tiles are too few to fill the
SMs: such shapes come out slower here than they run), the K loop's prologue, ping-pong
kernels that hide the epilogue.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from meshtrain.physics.gpus import gpu_of_device

BF16 = 2
# One thread block's output tile: 128 x 256 (x 64 in K), a tile of CUTLASS's SM90 bf16
# warp-specialized GEMMs (cutlass3x_sm90_tensorop_gemm_bf16_..._128x256x64 kernels); the
# matrix-multiplication guide above names 256x128 and 128x256 the most efficient of the
# tiles cuBLAS chooses from. cuBLAS picks per problem: we take the orientation with fewer
# waves, never a smaller tile.
TILE = (128, 256)
# NVIDIA, "Getting Started with CUDA Graphs" (2019): a 2.9 us kernel launched back to back
# on a stream takes 3.8 us per kernel: about 1 us each between kernels.
KERNEL_GAP = 1e-6
ASYMPTOTE = (8192, 8192, 8192)  # the shape physics/gpus.py's matmul_efficiency was measured on
# Measured tables ship with the package (pyproject's package-data), so an installed
# meshtrain plans as a checkout does; bench/ is not installed.
TABLES = Path(__file__).resolve().parents[1] / "physics" / "kernels"


def tiles(m: int, n: int) -> int:
    """Output tiles of an m x n result, the tile oriented for the fewer."""
    tm, tn = TILE
    return min(math.ceil(m / tm) * math.ceil(n / tn), math.ceil(m / tn) * math.ceil(n / tm))


def waves(m: int, n: int, sms: int) -> int:
    """Waves of output tiles over ``sms`` SMs: a partial last wave counts as a whole one."""
    return math.ceil(tiles(m, n) / sms)


def epilogue_seconds(m: int, n: int, gpu) -> float:
    """Every tile's C block (bf16) written at the copy bandwidth."""
    return tiles(m, n) * TILE[0] * TILE[1] * BF16 / gpu.hbm_bandwidth


def roofline_seconds(m: int, k: int, n: int, gpu) -> float:
    """The roofline with wave quantization and the tiles' epilogue, its full-wave rate set
    so that the 8192^3 matmul takes what physics/gpus.py measured."""
    am, ak, an = ASYMPTOTE
    measured = 2 * am * ak * an / (gpu.peak_bf16_flops * gpu.matmul_efficiency)
    # One wave over one K element, from the asymptote (its epilogue and gap are part of
    # what was measured).
    per_wave_k = (measured - epilogue_seconds(am, an, gpu) - KERNEL_GAP) / (waves(am, an, gpu.sms) * ak)
    compute = waves(m, n, gpu.sms) * k * per_wave_k
    memory = BF16 * (m * k + k * n + m * n) / gpu.hbm_bandwidth
    return max(compute + epilogue_seconds(m, n, gpu), memory) + KERNEL_GAP


def load_matmul_table(path: Path) -> tuple[str, tuple[tuple[int, int, int, float], ...]] | None:
    """(device name, ((m, k, n, FLOP/s), ...)) of a `bench.kernel_speeds` JSON; None for any
    other JSON, a --quick smoke run or a CPU run."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("quick", True) or not result.get("matmul"):
        return None
    if not isinstance(result.get("device"), str) or result["device"] == "cpu":
        return None
    rows = tuple((int(r["m"]), int(r["k"]), int(r["n"]), float(r["tflops"]) * 1e12) for r in result["matmul"])
    return result["device"], rows


def tables_by_gpu(folder: Path, load) -> dict[str, tuple]:
    """GPU name (physics/gpus.py) -> the rows ``load`` reads (device name, rows) from every
    kernel_speeds JSON in ``folder`` (the last file by name wins for a GPU measured more
    than once)."""
    tables = {}
    for path in sorted(Path(folder).glob("*.json")):
        loaded = load(path)
        gpu = gpu_of_device(loaded[0]) if loaded else None
        if gpu is not None:
            tables[gpu.name] = loaded[1]
    return tables


@lru_cache(maxsize=None)
def measured_tables(folder: Path) -> dict[str, tuple]:
    """GPU name -> its measured matmul rows (`tables_by_gpu`)."""
    return tables_by_gpu(folder, load_matmul_table)


def _roofline_rate(m: int, k: int, n: int, gpu) -> float:
    return 2 * m * k * n / roofline_seconds(m, k, n, gpu)


@lru_cache(maxsize=None)
def _log_ratios(rows: tuple, gpu) -> tuple[float, ...]:
    """log(measured / roofline) of each measured row: once per table, not per shape asked."""
    return tuple(math.log(rate / _roofline_rate(m, k, n, gpu)) for m, k, n, rate in rows)


def table_rate(rows, m: int, k: int, n: int, gpu) -> float:
    """FLOP/s at (m, k, n) from measured rows: a measured shape's own rate, else the
    roofline's rate times the measured-over-roofline ratio of the measured shapes, its log
    averaged with weights 1 / distance^4 in (log m, log k, log n). The ratio varies far
    less from shape to shape than the rate, and far from every measured shape the roofline's
    own shape dependence remains. Chosen by leaving each row of the H100 table out and
    predicting it from the rest (tests/test_matmul.py): median error 4%, against 7% for
    the same weights on the rates themselves and 23% for the roofline alone."""
    weights = []
    for rm, rk, rn, rate in rows:
        d2 = math.log(m / rm) ** 2 + math.log(k / rk) ** 2 + math.log(n / rn) ** 2
        if d2 == 0:
            return rate
        weights.append(1 / d2**2)
    logs = _log_ratios(tuple(rows), gpu)
    return _roofline_rate(m, k, n, gpu) * math.exp(sum(w * x for w, x in zip(weights, logs)) / sum(weights))


@lru_cache(maxsize=65536)
def gemm_seconds(m: int, k: int, n: int, gpu) -> float:
    """Seconds of (m x k) @ (k x n) in bf16 on ``gpu``: measured rates where physics/kernels/
    has them for this GPU, the roofline elsewhere. Cached: the search asks for few shapes
    many times."""
    rows = measured_tables(TABLES).get(gpu.name)
    if rows:
        return 2 * m * k * n / table_rate(rows, m, k, n, gpu)
    return roofline_seconds(m, k, n, gpu)


def linear_seconds(tokens: int, d_in: int, d_out: int, gpu) -> tuple[float, float]:
    """(forward, backward) of a Linear: tokens x in @ in x out forward; backward the input
    gradient (tokens x out @ out x in) and the weight gradient (in x tokens @ tokens x out)."""
    return gemm_seconds(tokens, d_in, d_out, gpu), (gemm_seconds(tokens, d_out, d_in, gpu)
                                                    + gemm_seconds(d_in, tokens, d_out, gpu))
