"""The planner's model of `[optimizer] name = "Muon"` (planning/muon.py) against torch's
Newton-Schulz and the dry run.

Newton-Schulz FLOPs are counted by torch's FlopCounterMode on torch.optim._muon's own
function; each rank's share is ceil(k / W) whole matrices of each shape group. The memory
and the all-to-all bytes are compared with a dry run of the layout (planning/verify.trace:
training/muon.py's DTensor redistribute traced on fake tensors as a GPU runs it, one
all-to-all per sharding mesh dimension). Llama 3 8B's block at a small vocabulary and short
sequences, so the optimizer step is the step's peak. Leaving Muon's step out of the memory
model fails the memory check (-19% on fsdp4_tp2); counting one all-to-all per group instead
of two fails the bytes check.
"""

import math
from functools import lru_cache

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.utils.flop_counter import FlopCounterMode

from meshtrain.models import registry
from meshtrain.parallel import ParallelDims
from meshtrain.physics.gpus import GIB, get_gpu
from meshtrain.planning import muon
from meshtrain.planning.estimate import estimate
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import Job
from meshtrain.planning.shares import rank_shares
from meshtrain.planning.verify import trace

H100 = get_gpu("h100-80gb")
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch.optim.Muon's defaults: coefficients, steps, eps

POINTS = {  # name -> (layers, layout)
    "fsdp8": (16, dict(dp_shard=8, ac="full", micro_batch=1)),
    "fsdp4_tp2": (8, dict(dp_shard=4, tp=2, ac="full", micro_batch=1)),
    "hsdp2x4": (8, dict(dp_shard=2, dp_replicate=4, strategy="HYBRID_SHARD", ac="full", micro_batch=1)),
    # 3 layers: wq's and wo's three matrices each (colwise, rowwise: two groups under TP)
    # pad to 8 apiece; taken as one group of 6 they would pad to 8 in all.
    "fsdp4_tp2_3_layers": (3, dict(dp_shard=4, tp=2, ac="full", micro_batch=1)),
}


def _job(n_layers: int, seq: int = 256, vocab: int = 8192) -> Job:
    family = registry.get("llama")
    model = family.model_class().from_flavor("8B", meta=True, vocab_size=vocab, n_layers=n_layers)
    fraction, shapes = muon.hidden_shapes(model, family.output_layer)
    return Job(resolve_model("8B", n_layers=n_layers, vocab_size=vocab), H100, 1, 8, seq, 8,
               muon=fraction, muon_shapes=shapes)


def _torch_flops(rows: int, cols: int) -> int:
    # On meta tensors: the counter reads shapes, and a CPU without native bf16 matmuls takes
    # minutes over the 8B shapes' bf16 iterations.
    with FlopCounterMode(display=False) as counter:
        _zeropower_via_newtonschulz(torch.randn(rows, cols, device="meta"), *NS)
    return counter.get_total_flops()


@pytest.mark.parametrize("rows,cols", [(48, 80), (80, 48), (64, 64)])
def test_newton_schulz_flops_are_what_torch_counts_on_its_own_function(rows, cols):
    assert muon.newton_schulz_flops(rows, cols, NS[1]) == _torch_flops(rows, cols)


def test_each_rank_orthogonalises_ceil_k_over_w_of_each_shape_at_the_matmul_speed():
    """Llama 3 8B at 8 FSDP ranks: 32 of each of wq, wk, wv, wo, w1, w2, w3; a rank owns 4 of
    each (8 of the shapes two projections share), FLOPs counted by torch on one of each."""
    job = _job(32)
    lay = ParallelDims(world_size=8, dp_shard=8)
    dim, kv, ffn = 4096, 1024, 14336
    one_layer = (2 * _torch_flops(dim, dim) + 2 * _torch_flops(kv, dim)
                 + 2 * _torch_flops(ffn, dim) + _torch_flops(dim, ffn))
    hand = math.ceil(32 / 8) * one_layer / (H100.peak_bf16_flops * H100.matmul_efficiency)
    assert muon.compute_seconds(job, lay, rank_shares(job, lay)[0]) == pytest.approx(hand, rel=1e-12)
    e = estimate(job, lay)
    # Without TP every matrix of one shape is sharded alike: one group per shape (wq and wo
    # together, wk and wv together), 64 matrices each for 4096^2 and 1024 x 4096.
    by_shape = {(dim, dim): 64, (kv, dim): 64, (ffn, dim): 64, (dim, ffn): 32}
    assert sum(k for _, _, k, _ in job.muon_shapes) == sum(by_shape.values())
    a2a = 2 * sum(job.net.seconds("all-to-all", 2 * k * r * c / 8, 8, 1) for (r, c), k in by_shape.items())
    assert e.times["muon"] == pytest.approx(hand + a2a, rel=1e-12)
    plain = estimate(Job(job.model, H100, 1, 8, job.seq_len, 8), lay)
    assert e.step_time - plain.step_time == pytest.approx(e.times["muon"] + e.times["optimizer"]
                                                          - plain.times["optimizer"], rel=1e-9)


@lru_cache(maxsize=None)
def _estimated_and_traced(name: str):
    layers, lay = POINTS[name]
    job = _job(layers)
    e = estimate(job, ParallelDims(world_size=job.world, **lay))
    return e, trace(e, job)


@pytest.mark.slow  # two dry runs of 8B blocks at 8 ranks (a few seconds each)
@pytest.mark.parametrize("name", list(POINTS))
def test_muon_estimate_within_10_percent_of_the_traced_peak(name):
    e, report = _estimated_and_traced(name)
    traced = report["memory"]["total"]
    assert traced == pytest.approx(e.memory.total, rel=0.10), \
        f"estimated {e.memory.total / GIB:.2f} GiB, traced {traced / GIB:.2f} GiB ({traced / e.memory.total - 1:+.1%})"


@pytest.mark.slow  # the same dry runs (cached)
@pytest.mark.parametrize("name", list(POINTS))
def test_muon_all_to_all_bytes_equal_the_traced_step(name):
    e, report = _estimated_and_traced(name)
    for dim in ("dp_shard", "tp"):
        sent = report["comm"].get((dim, "all-to-all"), (0, 0, 0.0))[2]
        assert e.comm_bytes.get(f"muon_{dim}", 0.0) == pytest.approx(sent, rel=1e-9), dim
    assert e.comm_bytes["muon_dp_shard"] > 0
