"""The planner's model of a mixture of experts under expert parallelism, against the dry run.

Each layout is estimated (planning/estimate.py: experts split over ep and FSDP-sharded over
dp_shard / ep, an MoE block gathering its n_experts / ep experts, the dispatch and combine
all-to-alls), written as a train.py config and dry-run at its world size on fake tensors
(planning/verify.trace: the real ExpertParallel dispatch, FSDP over the expert mesh,
torch's memory tracker and every collective counted as dispatched). The dry run routes
evenly (the group sizes are data a fake tensor does not have), so the estimate is made at a
routing imbalance of 1, like for like.

Qwen3-30B-A3B's shape, cut to 4 blocks, at 8 ranks: the layouts cross ep 2 and 4 with FSDP,
with TP 2, with a pipeline, and ep 1 (the experts gathered whole), and AC none, full and
selective. Leaving the ep division out of the gathered MoE block fails the memory check
(+20% on the tp 2 point) and out of the all-to-all bytes the traffic check.
"""

from functools import lru_cache

import pytest

from meshtrain.models.moe.model import MoETransformer
from meshtrain.parallel import ParallelDims
from meshtrain.physics.gpus import GIB, get_gpu
from meshtrain.planning.estimate import estimate
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import Job
from meshtrain.planning.verify import trace

H100 = get_gpu("h100-80gb")

POINTS = {  # name -> (sequence length, layout)
    "ep2_fsdp8": (4096, dict(ep=2, dp_shard=8, micro_batch=2, ac="none")),
    "ep4_fsdp8_full": (1024, dict(ep=4, dp_shard=8, micro_batch=2, ac="full")),
    "ep2_tp2_selective": (1024, dict(ep=2, tp=2, dp_shard=4, micro_batch=2, ac="selective")),
    "ep1_fsdp8_full": (1024, dict(ep=1, dp_shard=8, micro_batch=2, ac="full")),
    "ep2_pp2_1f1b": (1024, dict(ep=2, pp=2, dp_shard=4, micro_batch=1, ac="none", strategy="SHARD_GRAD_OP",
                                pp_schedule="1F1B", pp_microbatches=4)),
}


def _job(seq: int, imbalance: float = 1.0) -> Job:
    return Job(resolve_model("moe:qwen3_30b_a3b", n_layers=4), H100, 1, 8, seq, 16, moe_imbalance=imbalance)


@lru_cache(maxsize=None)
def _estimated_and_traced(name: str):
    seq, lay = POINTS[name]
    job = _job(seq)
    e = estimate(job, ParallelDims(world_size=job.world, **lay))
    return e, trace(e, job)


@pytest.mark.parametrize("flavor", ["debug", "qwen3_30b_a3b", "deepseek_v3_671b"])
def test_moe_shape_counts_the_models_parameters_and_active_parameters(flavor):
    shape = resolve_model(f"moe:{flavor}")
    model = MoETransformer.from_flavor(flavor, meta=True, vocab_size=shape.vocab)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.active_params == model.active_parameters()  # what training/metrics.py counts MFU on
    assert shape.moe_layers == len(model.moe_layers())


@pytest.mark.slow  # five dry runs of a 30B-class shape (about 40 s on two cores)
@pytest.mark.parametrize("name", list(POINTS))
def test_moe_estimate_within_10_percent_of_the_traced_peak(name):
    e, report = _estimated_and_traced(name)
    traced = report["memory"]["total"]
    assert traced == pytest.approx(e.memory.total, rel=0.10), \
        f"estimated {e.memory.total / GIB:.2f} GiB, traced {traced / GIB:.2f} GiB ({traced / e.memory.total - 1:+.1%})"


@pytest.mark.slow  # the same dry runs as above (cached)
@pytest.mark.parametrize("name", list(POINTS))
def test_moe_all_to_all_and_expert_fsdp_bytes_equal_the_traced_step(name):
    """The bytes one rank sends per step in the ep all-to-alls (dispatch, combine, their
    gradients, the counts, and again where AC recomputes) and in the experts' FSDP
    collectives over dp_shard / ep: the estimate's formula equals what the traced step
    dispatches, to the byte."""
    e, report = _estimated_and_traced(name)
    sent = lambda dim, *kinds: sum(report["comm"].get((dim, kind), (0, 0, 0.0))[2] for kind in kinds)
    if e.layout.ep == 1:
        assert "ep" not in e.comm_bytes and sent("ep", "all-to-all") == 0
        return
    assert e.comm_bytes["ep"] == pytest.approx(sent("ep", "all-to-all"), rel=1e-9)
    assert e.comm_bytes["dp_shard_mod_ep"] == pytest.approx(
        sent("dp_shard_mod_ep", "all-gather", "reduce-scatter"), rel=1e-9)


def test_the_search_offers_each_ep_that_divides_dp_shard_and_the_experts_and_only_where_ep_runs():
    from meshtrain.planning.search import candidates, check_layout

    job = Job(resolve_model("moe:deepseek_v3_671b"), H100, 32, 8, 4096, 1024)
    seen = {}
    for lay in candidates(job):
        if lay.pp == 1 and lay.micro_batch == 1 and lay.ac == "full":
            seen.setdefault((lay.tp, lay.dp_replicate, lay.strategy), set()).add(lay.ep)
            check_layout(job, lay)  # train.py's own rules (ParallelDims.ep_problems) accept each
    # tp 1: dp_shard 256, every power of two up to the 256 experts; tp 8: dp_shard 32.
    assert seen[(1, 1, "FULL_SHARD")] == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert seen[(8, 1, "SHARD_GRAD_OP")] == {1, 2, 4, 8, 16, 32}
    assert seen[(1, 2, "HYBRID_SHARD")] == {1}  # ep with replicas is refused by train.py
    dense = Job(resolve_model("8B"), H100, 1, 8, 4096, 16)
    assert {lay.ep for lay in candidates(dense)} == {1}


def test_routing_imbalance_weighs_on_the_busiest_ranks_memory_and_time_not_on_the_bytes():
    seq, lay = POINTS["ep2_fsdp8"]
    even, skewed = (estimate(_job(seq, imb), ParallelDims(world_size=8, **lay)) for imb in (1.0, 1.5))
    assert skewed.memory.total > even.memory.total and skewed.step_time > even.step_time
    assert skewed.times["ep"] == pytest.approx(even.times["ep"] * 1.5, rel=0.05)  # the bytes dominate the latency
    assert skewed.comm_bytes == even.comm_bytes  # the mean over the ranks, whatever the routing


@pytest.mark.slow  # DeepSeek-V3's shape dry-run at 256 ranks: about 80 s on two cores
def test_deepseek_v3_671b_at_256_ranks_estimate_matches_its_dry_run():
    """The 671B shape at 256 H100s, FSDP 256 x ep 16, full AC, 4 sequences of 4096 tokens per
    rank: the estimate (at the default routing imbalance) within 10% of the traced peak, and
    its all-to-all bytes those of the traced step."""
    job = Job(resolve_model("moe:deepseek_v3_671b"), H100, 32, 8, 4096, 1024)
    e = estimate(job, ParallelDims(world_size=256, dp_shard=256, ep=16, ac="full", micro_batch=4))
    report = trace(e, job)
    traced = report["memory"]["total"]
    assert traced == pytest.approx(e.memory.total, rel=0.10), (traced / GIB, e.memory.total / GIB)
    assert e.comm_bytes["ep"] == pytest.approx(report["comm"][("ep", "all-to-all")][2], rel=1e-9)


@pytest.mark.parametrize("value", ["0.5", "nan", "inf"])
def test_plan_refuses_an_imbalance_below_one_with_the_flag_named(value, capsys):
    from meshtrain.planning.plan import run as plan_run

    args = ["--model", "moe:debug", "--nodes", "1", "--seq-len", "128", "--global-batch", "8"]
    assert plan_run([*args, "--moe-imbalance", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"meshtrain: error: --moe-imbalance {float(value)}") and "\n" not in err
