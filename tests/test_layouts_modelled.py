"""Layouts the trainer runs that the planner used to refuse: plain data parallelism
(NO_SHARD, DDP) and GPipe with fewer micro-batches than stages, estimated and searched,
against the ZeRO paper's accounting and hand arithmetic. One process, no GPU."""

import pytest

from meshtrain.parallel import LayoutError, ParallelDims
from meshtrain.parallel.pipeline import check_pipeline
from meshtrain.physics.gpus import get_gpu
from meshtrain.planning.estimate import estimate, estimate_config
from meshtrain.planning.memory import BF16, FP32, zero_model_states
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.report import to_toml
from meshtrain.planning.search import candidates, check_layout
from meshtrain.planning.shape import Job
from meshtrain.training.config_loader import load_config

H100 = get_gpu("h100-80gb")
US = 1e-6


@pytest.fixture(scope="module")
def job1b():
    return Job(resolve_model("1B"), H100, 1, 8, 4096, 32)


def no_shard(micro_batch=4, world=8, **kw):
    return ParallelDims(tp=1, pp=1, dp_replicate=world, dp_shard=1, world_size=world, strategy="NO_SHARD", ac="none",
                        micro_batch=micro_batch, **kw)


def test_no_shard_holds_whole_model_states_as_zero_baseline_dp(job1b):
    # ZeRO (Rajbhandari et al. 2019, Fig. 1), baseline DP: K = 12 bytes of optimizer state per
    # parameter (fp32 master copy + Adam m, v) on every GPU, not divided by N_d; ours keeps the
    # fp32 master copy as the parameter (4) and m, v (8). FULL_SHARD divides both by 8.
    psi, lay = job1b.model.n_params, no_shard()
    check_layout(job1b, lay)
    mem = estimate(job1b, lay).memory
    k_psi = zero_model_states(psi, 8, "baseline") - (2 + 2) * psi     # the paper's K·Ψ, unsharded
    assert mem.params + mem.optimizer == pytest.approx(k_psi)
    full = estimate(job1b, ParallelDims(**{**lay.__dict__, "dp_replicate": 1, "dp_shard": 8,
                                           "strategy": "FULL_SHARD"})).memory
    assert full.params + full.optimizer == pytest.approx(k_psi / 8)
    # Never resharded: the whole model's bf16 copy stays from forward to backward.
    assert mem.transient >= BF16 * psi
    # A config may say NO_SHARD with dp_shard = 8: parallel/fsdp.py makes every rank a
    # replica all the same, and so does the estimate.
    as_shard = ParallelDims(**{**lay.__dict__, "dp_replicate": 1, "dp_shard": 8})
    check_layout(job1b, as_shard)
    same = estimate(job1b, as_shard)
    assert same.memory.total == mem.total and same.fsdp_comm_time == estimate(job1b, lay).fsdp_comm_time


def test_no_shard_all_reduces_fp32_gradients_every_micro_batch_by_hand(job1b):
    # 32 sequences over 8 replicas: 4 each, micro-batch 2 -> 2 accumulation steps, each
    # ending in a ring all-reduce of the fp32 gradients inside one node (14 steps, NVLink
    # 450 GB/s x 0.8), one per FSDP unit (16 blocks + one unit of the tied embedding, final
    # norm and output, models/common.py = 17: the dry run traces 34 all-reduces and the norm's).
    lay = no_shard(micro_batch=2)
    e = estimate(job1b, lay)
    psi = job1b.model.n_params
    assert e.comm_bytes["dp_shard"] == 0
    assert e.comm_bytes["dp_replicate"] == pytest.approx(2 * 2 * 7 / 8 * FP32 * psi)
    unit = FP32 * psi / 17
    ring = 8.4 * US + 14 * 3.4 * US + 2 * 7 / 8 * unit / (450e9 * 0.8)
    assert e.fsdp_comm_time == pytest.approx(2 * 17 * ring, rel=1e-9)


def test_no_shard_is_searched_and_its_config_is_estimated_as_searched(job1b, tmp_path):
    lays = [lay for lay in candidates(job1b) if lay.strategy == "NO_SHARD"]
    assert lays and all(lay.dp_shard == 1 and lay.dp_replicate == lay.dp > 1 for lay in lays)
    lay = next(lay for lay in lays if lay.tp == 2 and lay.micro_batch == 2 and lay.ac == "full")
    (tmp_path / "ddp.toml").write_text(to_toml(estimate(job1b, lay), job1b, "ddp", "test"))
    got = estimate_config(load_config(tmp_path / "ddp.toml"), job1b.world, 8, H100)
    assert got.layout == lay and got.memory.total == estimate(job1b, lay).memory.total


def test_gpipe_runs_fewer_micro_batches_than_stages_and_the_refusal_names_it():
    job = Job(resolve_model("8B"), H100, 1, 8, 8192, 4)
    with pytest.raises(LayoutError, match=r"pp_microbatches = 2 < 4 stages \(GPipe runs it\)"):
        check_pipeline(pp=4, n_layers=32, schedule="1F1B", stages_per_rank=1, n_microbatches=2, local_batch=2)
    lay = ParallelDims(tp=1, pp=4, dp_replicate=1, dp_shard=2, world_size=8, strategy="SHARD_GRAD_OP", ac="full",
                       micro_batch=1, pp_schedule="GPipe", pp_microbatches=2)
    check_layout(job, lay)
    e = estimate(job, lay)
    # GPipe: every micro-batch's forwards, then every backward. With stage times c_i per
    # micro-batch the step is sum(c_i) + (m - 1) max(c_i), of which m max(c_i) is the
    # slowest rank's work: a bubble of the other stages' sum(c_i) - max(c_i) -- (pp - 1) c
    # for equal stages. The last stage also runs the output layer and the loss (the
    # heaviest); every other stage is within that of it: between (pp - 2) and (pp - 1)
    # of the heaviest's time (tests/test_schedule.py checks the makespan exactly).
    busy = e.times["compute"] + e.times["tp"]
    c_max = busy / 2
    assert (4 - 2) * c_max < e.times["bubble"] < (4 - 1) * c_max
    # The search offers GPipe only where 1F1B is refused, and then it is there.
    offered = [lay for lay in candidates(job) if lay.pp_schedule == "GPipe" and lay.pp > 1]
    assert offered and all(lay.pp_microbatches < lay.pp for lay in offered)
