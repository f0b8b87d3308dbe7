"""The planner's step time against measured runs (bench/step_time_validation.py).

Our own: bench/gpu_check.py's six bf16 runs on one H100 SXM (Llama 3 8B's block, eager and
compiled, AC none / op / full; bench/results/2026-11-22_h100_run5.json) are estimated within
15% (-7% to -1%). Running attention at the matmul's speed and leaving the memory-bound work
out (near the flat model this replaced) puts them at +54% to +97%, and leaving only the
eager RMSNorm's fp32 passes out puts two of the three eager runs at +23% and +25%: the
check fails for either. The passes over the parameters (planning/param_passes.py) are held
to the kernels that ran them in torch's profile of the same step.

Published: Megatron-LM's weak-scaling rows with a pipeline are within 15% (-12% to -7%, TP overlapped
with the GEMMs as the README says they ran; -27% to -17% counted exposed); the rows where
the estimate misses (docs/planning.md names each cause) are pinned to the side they miss
on, so a change that moves them is seen.
"""

import contextlib
import dataclasses
import types
import importlib.util
from pathlib import Path

import pytest

from meshtrain.planning.estimate import estimate

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("step_time_validation", ROOT / "bench/step_time_validation.py")
validation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validation)


def error(row) -> float:
    return estimate(row["job"], row["layout"]).tokens_per_s_per_gpu / row["measured"] - 1


@pytest.mark.parametrize("row", validation.ours(), ids=lambda r: r["run"])
def test_within_15_percent_of_our_measured_h100_runs(row):
    assert abs(error(row)) <= 0.15, f"{error(row):+.0%}"


def test_megatron_pipeline_rows_within_15_percent_and_the_1_7b_row_optimistic():
    rows = validation.megatron()
    assert len(rows) == 9
    for row in rows:
        if row["layout"].pp > 1:
            # Pessimistic by what an FSDP2 stage pays per micro-batch (an fp32 copy of each
            # gradient, planning/param_passes.py), which Megatron fuses into its weight-gradient
            # GEMM (gradient_accumulation_fusion), the SMs hidden data-parallel traffic holds
            # (planning/hardware.py) and the copies torch makes around sequence-parallel
            # collectives, which Megatron's sequence-first activations do not need
            # (tp_layout_copies). Their TP collectives run inside the GEMMs (--tp-comm-overlap,
            # the README's paragraph above the table: overlapped_tp_seconds); counted exposed,
            # these rows were -27% to -17%.
            assert -0.15 <= error(row) <= 0.15, (row["run"], f"{error(row):+.0%}")
        else:  # By the measured H100 tables: 1.7B +30% (+39% by the roofline), 7.1B +18%,
            # 16B +5%, 32B +0% (-18% with TP exposed; docs/planning.md): what is left of the
            # 1.7B miss is not the matmuls' speed.
            assert -0.25 < error(row) < 0.4, (row["run"], f"{error(row):+.0%}")
            if row["job"].model.dim < 4096:
                assert error(row) > 0.15, (row["run"], f"{error(row):+.0%}")


PROFILE = ROOT / "bench/results/2026-11-26_h100_ac_policy_profile.txt"
# The kernels that pass over the parameters in that profile, one FSDP rank: FSDP2's one-rank
# path (aten::copy_: each parameter cast and copied into place per gather, the reduce's input
# copied to its output; chunk_cat into that input), the gradient norm and its scaling, fused
# AdamW. Units over several ranks take another path (copy-in, all-gather, copy-out), whose
# counts are torch's code read, not measured here.
PASS_OPS = ("aten::copy_", "aten::_chunk_cat", "aten::_foreach_norm", "aten::_foreach_mul_", "aten::_fused_adamw_")


def profile_self_cuda(section: str) -> dict[str, float]:
    """Self CUDA seconds by op name from one section of torch's profiler table."""
    import re

    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
    rows, inside = {}, False
    for line in PROFILE.read_text().splitlines():
        if line.startswith("=="):
            inside = line.strip("= ").startswith(section)
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if inside and len(cells) == 11 and cells[0] != "Name" and not cells[0].startswith("-"):
            value = re.fullmatch(r"([\d.]+)(us|ms|s)", cells[6])
            rows[cells[0]] = float(value[1]) * unit[value[2]]
    return rows


def test_the_passes_over_the_parameters_take_what_the_h100_profile_measured():
    """torch's profile of two bf16 steps (10 Llama-3-8B blocks, one 8,192-token sequence,
    compiled, op AC, one H100 FSDP rank: the run5 row 'compile ac=op'): the kernels above
    took 88 ms a step; the planner charges its FSDP copies, clipping and AdamW 76 ms (-14%).
    Without the clipping it would charge 63 (-28%), without FSDP's copies 43: the check fails."""
    measured = sum(profile_self_cuda("bf16 ac=op default")[op] for op in PASS_OPS) / 2
    row = next(r for r in validation.ours() if r["run"].endswith("compile ac=op"))
    times = estimate(row["job"], row["layout"]).times
    planned = times["fsdp_copies"] + times["clip"] + times["optimizer"]
    assert planned == pytest.approx(measured, rel=0.15), (planned, measured)


def test_torchtitan_rows_are_all_optimistic():
    # Their H100s run at 500 W with HBM2e (peak "between SXM and NVL", their footnote): on
    # our 700 W H100 the same block reaches 45.6% / 50.7% MFU, on theirs 33.7% / 39.0%: 1.30x
    # to 1.35x. Their TP 8 rows pay the copies around sequence-parallel collectives as meshtrain
    # does (70B +37% -> +29% once counted), a few points under that ratio. With the matmuls
    # at the measured H100 table's speeds: +16% (70B) to +48% (8B FSDP 128, compiled).
    for row in validation.torchtitan():
        assert 0.1 < error(row) < 0.6, (row["run"], f"{error(row):+.0%}")


def test_a_pipelines_sends_are_on_the_timeline_gpipe_pays_its_fill_and_drain_hops():
    """GPipe over 8 nodes (pp 8, TP 8): each send between stages -- latency plus the
    sequence-sharded activation's bytes through the NIC (planning/hardware.py) -- delays the
    next stage's action. The fill crosses pp - 1 boundaries down and the drain pp - 1 back
    up; the steady state has slack, so the step's pipeline transfer time is 2 (pp - 1)
    hops, not the sends' sum over every micro-batch."""
    from meshtrain.parallel import ParallelDims
    from meshtrain.planning.step_time import step_time

    job = validation.megatron()[6]["job"]  # GPT 177B: 96 layers, 4096 tokens, hidden 12288
    pp, t, m = 8, 8, 16
    lay = ParallelDims(tp=t, pp=pp, pp_schedule="GPipe", pp_microbatches=m, stages_per_rank=1, dp_replicate=1,
                       dp_shard=job.world // (t * pp), world_size=job.world, strategy="SHARD_GRAD_OP", ac="full",
                       micro_batch=1)
    hop = job.net.seconds("send/recv", 2 * 4096 * job.model.dim / t, pp, t * lay.dp)
    assert hop > 0
    assert step_time(job, lay).times["pp"] == pytest.approx(2 * (pp - 1) * hop, rel=1e-6)


def test_the_passes_over_the_parameters_cover_what_trains():
    """[lora] trains a fraction of the parameters: the frozen base is still gathered (and
    copied) every round, but has no gradient to reduce, clip or update; under Muon its
    matrices are not AdamW's. Charging every parameter, as for full training, fails this."""
    import dataclasses

    from meshtrain.planning.step_time import step_time

    row = next(r for r in validation.ours() if r["run"].endswith("compile ac=op"))
    times = lambda **kw: step_time(dataclasses.replace(row["job"], **kw), row["layout"]).times
    full, frozen, lora = times(), times(trainable=0.0), times(trainable=0.01)
    assert frozen["fsdp_copies"] > 0 and frozen["clip"] == frozen["optimizer"] == 0
    reduce = full["fsdp_copies"] - frozen["fsdp_copies"]
    assert reduce > 0 and lora["fsdp_copies"] == pytest.approx(frozen["fsdp_copies"] + 0.01 * reduce, rel=1e-9)
    assert lora["clip"] == pytest.approx(0.01 * full["clip"], rel=1e-9)
    assert lora["optimizer"] == pytest.approx(0.01 * full["optimizer"], rel=1e-9)
    assert times(muon=0.8)["optimizer"] == pytest.approx(0.2 * full["optimizer"], rel=1e-9)


def test_fsdp1_backward_post_waits_for_each_blocks_backward_gather():
    """FSDP1's BACKWARD_POST (Composer's default; torch's docs: "less overlap") issues a
    unit's backward all-gather from the post-backward hook of the unit behind it, once that
    one's gradients are done (torch/distributed/fsdp/_runtime_utils.py,
    _post_backward_reshard): each FULL_SHARD block's backward gather is on the critical
    path, every micro-batch. SHARD_GRAD_OP gathers nothing in backward, so it is unchanged.
    Dropping the term, or charging the forward's gathers too, fails this."""
    from meshtrain.planning.step_time import step_time

    row = next(r for r in validation.mosaic_rows() if r["source"] == "llm-foundry MPT-13b, 64 GPUs, seq 2,048")
    job, lay = row["job"], row["layout"]
    assert job.backward_prefetch is False  # as Composer ran it
    post, pre = step_time(job, lay), step_time(dataclasses.replace(job, backward_prefetch=True), lay)
    m = job.model
    block = job.net.seconds("all-gather", 2 * (m.layer_split + m.layer_replicated), lay.dp_shard, 1)
    from meshtrain.planning.shape import forwards_per_step
    n_mb = forwards_per_step(job, lay)
    assert post.times["fsdp"] - pre.times["fsdp"] == pytest.approx(n_mb * m.n_layers * block, rel=1e-9)
    assert post.fsdp_comm_time == pre.fsdp_comm_time  # the same bytes, less of them hidden
    zero2 = dataclasses.replace(lay, strategy="SHARD_GRAD_OP")
    assert step_time(job, zero2).seconds == step_time(dataclasses.replace(job, backward_prefetch=True), zero2).seconds

def test_llama3s_context_parallelism_moves_k_and_v_only():
    """Meta's CP (Llama 3, section 3.3.2) all-gathers the whole sequence's K and V in each
    forward, a recomputed block's again, and reduce-scatters their gradients in backward;
    queries and outputs stay put. With grouped-query attention that is far less than
    meshtrain's all-to-alls of q, k, v and the output (whose kv heads are repeated when a TP
    rank's one kv head cannot split over cp 16). Counting q or the output, or leaving out
    the recomputed block's gathers, fails this."""
    from meshtrain.planning.shape import forwards_per_step
    from meshtrain.planning.shares import checkpointed_blocks, rank_shares
    from meshtrain.planning.step_time import step_time

    row = next(r for r in validation.llama3_rows() if r["layout"].cp == 16)
    job, lay = row["job"], row["layout"]
    assert job.cp_kv_all_gather and lay.ac == "full"
    gathered, ulysses = step_time(job, lay), step_time(dataclasses.replace(job, cp_kv_all_gather=False), lay)
    m, t, cp = job.model, lay.tp, lay.cp
    kv = 2 * 2 * job.seq_len * lay.micro_batch * m.kv_dim / t  # k and v, bf16, this TP rank's heads
    layers = max(sh.layers for sh in rank_shares(job, lay))
    share = next(sh for sh in rank_shares(job, lay) if sh.layers == layers)
    ckpt = checkpointed_blocks(share, lay.ac)
    assert ckpt == layers  # full AC: every block's forward runs twice
    n_mb = forwards_per_step(job, lay)
    net = job.net
    expected = n_mb * ((layers + ckpt) * net.seconds("all-gather", kv, cp, t)
                       + layers * net.seconds("reduce-scatter", kv, cp, t))
    assert gathered.times["cp"] == pytest.approx(expected, rel=1e-9)
    assert gathered.comm_bytes["cp"] == pytest.approx(n_mb * (2 * layers + ckpt) * kv * (cp - 1) / cp, rel=1e-9)
    # Here the whole sequence's K and V of one kv head are half of what the all-to-alls move
    # (q and the output at 16 heads, k and v repeated to 16).
    assert gathered.comm_bytes["cp"] == pytest.approx(ulysses.comm_bytes["cp"] / 2, rel=1e-9)
    assert gathered.times["cp"] < ulysses.times["cp"]

def test_a_pipeline_keeps_an_fp32_copy_of_each_gradient_across_its_micro_batches():
    """torch's pipeline stage turns gradient sync off until the last micro-batch, so FSDP2
    upcasts each unsharded bf16 gradient to an fp32 copy on the first micro-batch and adds
    into it on every other (_fsdp_param.py: to_accumulated_grad_if_needed,
    accumulate_unsharded_grad_if_needed): 2 + 4 + 4 bytes per stage parameter for each
    micro-batch more. Without a pipeline each micro-batch reduces at once and only the
    shard's gradient accumulates (4 + 4 + 4 per shard parameter)."""
    from meshtrain.planning import param_passes as pp

    params, rounds = 1e9, (1, 1)
    one = pp.fsdp_copy_bytes(params, 8, rounds, microbatches=4, reduces_once=True)
    more = pp.fsdp_copy_bytes(params, 8, rounds, microbatches=5, reduces_once=True)
    assert more - one == pytest.approx(10 * params)
    flat = lambda n: pp.fsdp_copy_bytes(params, 8, (n, n))
    gather = pp.fsdp_copy_bytes(params, 8, (1, 0))
    assert flat(2) - flat(1) == pytest.approx(gather + 6 * params + 12 * params / 8)



@pytest.mark.parametrize("family", ["llama", "moe"])
@pytest.mark.parametrize("ac", ["none", "full", "selective", "op"])
@pytest.mark.parametrize("sequence_parallel, micro_batch", [(True, 1), (True, 2), (False, 1)])
def test_tp_collectives_and_layout_copies_are_those_torch_makes(fake_world, family, ac, sequence_parallel,
                                                                micro_batch):
    # A debug model at TP 2 under a fake process group, activation-checkpointed as train.py
    # does, over a forward and backward: every functional collective the TP plan's styles run
    # on a whole [batch, seq, dim] activation (gathered to it, scattered or all-reduced from
    # it; a redistribution DTensor ran inside an op's dispatch would not be seen here, and
    # CommDebugMode finds none but the logits' gather), and every copy it
    # makes of one (a `cat` with that many elements, in rank order [2 batch, seq / 2, dim] or
    # in place), against the counts the planner's step time charges. The MoE debug flavor
    # has a dense first layer and a shared expert.
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtrain.models.llama import Llama
    from meshtrain.models.moe.model import MoETransformer
    from meshtrain.parallel import ParallelDims, apply_ac
    from meshtrain.parallel.tensor_parallel import apply_tp
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.shape import Job, ModelShape
    from meshtrain.planning.shares import checkpointed_blocks, checkpointed_moe_blocks, rank_shares
    from meshtrain.planning.step_time import tp_collectives, tp_layout_copies

    fake_world(2)
    torch.manual_seed(0)
    # A vocabulary whose TP shard is not the model width, so no logits `cat` is counted.
    model = (Llama if family == "llama" else MoETransformer).from_flavor("debug", vocab_size=512)
    apply_tp(model, init_device_mesh("cpu", (2,)), model.tp_plan(sequence_parallel=sequence_parallel))
    apply_ac(model.transformer_blocks(), ac, every=2)
    seq, dim = 64, model.cfg.dim
    whole = micro_batch * seq * dim
    shapes = {(micro_batch, seq, dim), (2 * micro_batch, seq // 2, dim)}
    kinds = {"all_gather_into_tensor": "gs", "reduce_scatter_tensor": "gs", "all_reduce": "ar"}

    class ActivationTraffic(TorchDispatchMode):
        cats, gs, ar = 0, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and tuple(out.shape) in shapes:
                self.cats += 1
            kind = kinds.get(func.__name__.split(".")[0]) if func.namespace == "_c10d_functional" else None
            if kind and whole in (args[0].numel(), out.numel()):
                setattr(self, kind, getattr(self, kind) + 1)
            return out

    tokens = torch.randint(0, 512, (micro_batch, seq))
    with ActivationTraffic() as seen:
        model(tokens).float().logsumexp(-1).full_tensor().sum().backward()
    shape = ModelShape.from_model(model, flavor="debug", n_layers=model.cfg.n_layers, family=family,
                                  learned_positions=False)
    job = Job(shape, get_gpu("h100-80gb"), 1, 2, seq, micro_batch)
    lay = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=1, world_size=2, strategy="FULL_SHARD", ac=ac,
                       micro_batch=micro_batch)
    (share,) = rank_shares(job, lay)
    ckpt, ckpt_moe = checkpointed_blocks(share, ac), checkpointed_moe_blocks(share, ac)
    assert (seen.gs, seen.ar) == tp_collectives(share, ckpt, ckpt_moe, sequence_parallel=sequence_parallel,
                                                shared_experts=shape.shared_hidden > 0)
    recomputed = share.layers if ac == "op" else ckpt
    assert seen.cats == (tp_layout_copies(share, recomputed, micro_batch) if sequence_parallel else 0)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_hugging_face_tp_all_reduces_are_those_torch_makes(fake_world, arch, ac):
    # transformers' own plans at TP 2 (no sequence parallelism): each column-split Linear
    # all-reduces its input gradient alone (q, k, v, gate and up: 7 per Llama-like block, not
    # the native plans' 4); GPT-NeoX (fused qkv) 4. Counted on a forward and backward,
    # against the planner's count from the model's own plan.
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtrain.models.hf.model import build_hf
    from meshtrain.parallel import ParallelDims, apply_ac
    from meshtrain.parallel.tensor_parallel import apply_tp
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.shape import Job, ModelShape
    from meshtrain.planning.shares import checkpointed_blocks, checkpointed_moe_blocks, rank_shares
    from meshtrain.planning.step_time import tp_collectives
    from tests.hf_configs import ARCHS, COMMON

    fake_world(2)
    model = build_hf("", hf=ARCHS[arch] if arch == "gpt_neox" else {**COMMON, **ARCHS[arch]})
    shape = ModelShape.from_model(model, flavor=arch, n_layers=len(model.transformer_blocks()), family="hf",
                                  learned_positions=False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    apply_tp(model, init_device_mesh("cpu", (2,)), model.tp_plan())
    apply_ac(model.transformer_blocks(), ac, every=2)
    seq = 32
    whole = seq * model.cfg.dim

    class AllReduces(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "_c10d_functional" and func.__name__.startswith("all_reduce") \
                    and args[0].numel() == whole:
                self.count += 1
            return out

    with AllReduces() as seen:
        logits = model(torch.randint(0, model.cfg.vocab_size, (1, seq)))
        logits.to_local().float().sum().backward()
    job = Job(shape, get_gpu("h100-80gb"), 1, 2, seq, 1, sequence_parallel=False)
    lay = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=1, world_size=2, strategy="FULL_SHARD", ac=ac)
    (share,) = rank_shares(job, lay)
    assert (0, seen.count) == tp_collectives(share, checkpointed_blocks(share, ac), checkpointed_moe_blocks(share, ac),
                                             sequence_parallel=False, shared_experts=False,
                                             reductions=shape.tp_reductions)


def test_without_sequence_parallelism_tp_makes_no_layout_copies():
    # [parallelism] sequence_parallel = false, and Hugging Face models (whose TP plans never
    # apply it): no sequence-sharded activation, nothing to put in rank order.
    import dataclasses

    from meshtrain.parallel import ParallelDims
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.plan import resolve_model
    from meshtrain.planning.shape import Job

    job = Job(resolve_model("8B"), get_gpu("h100-80gb"), 1, 8, 8192, 16)
    lay = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=4, world_size=8, strategy="FULL_SHARD", ac="none",
                       micro_batch=2)
    sp, no_sp = estimate(job, lay), estimate(dataclasses.replace(job, sequence_parallel=False), lay)
    act, n_mb = 2 * 2 * 8192 * 4096, 2
    copies = (4 * 32 + 2) * 2  # both kinds at micro-batch 2, no recompute
    gathers = (8 * 32 + 4) * job.net.seconds("all-gather", act, 2, 1)
    assert sp.times["tp"] == pytest.approx(n_mb * (gathers + copies * 2 * act / job.gpu.hbm_bandwidth), rel=1e-9)
    # Without it, all-reduces: two per block forward, two backward, one for each end.
    assert no_sp.times["tp"] == pytest.approx(n_mb * (4 * 32 + 2) * job.net.seconds("all-reduce", act, 2, 1),
                                              rel=1e-9)


def test_lora_under_tp_is_estimated_with_a_warning_that_its_tp_time_is_low():
    # [lora]'s wrapped column-split Linears each all-reduce their own input gradient, which
    # the TP count does not include: the estimate says so wherever tp > 1, and only there.
    import dataclasses

    from meshtrain.parallel import ParallelDims
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.plan import resolve_model
    from meshtrain.planning.shape import Job

    job = Job(resolve_model("8B"), get_gpu("h100-80gb"), 1, 8, 4096, 16)
    lora = dataclasses.replace(job, lora=(16, 32, ("wq", "wv")))
    tp2 = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=4, world_size=8, strategy="FULL_SHARD", ac="full")
    tp1 = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=8, world_size=8, strategy="FULL_SHARD", ac="full")
    assert any("tp=2 with [lora]" in w for w in estimate(lora, tp2).warnings)
    assert not estimate(lora, tp1).warnings and not estimate(job, tp2).warnings


def test_async_tp_gains_what_torchtitan_measured_it_gains():
    # torchtitan's asyncTP benchmark ran the same two layouts without and with it: 1.10x for
    # 8B at FSDP 8 x TP 8, 1.09x for 70B at FSDP 32 x TP 8. Hiding all that could hide
    # (realised 1.0) gives 1.28x and 1.22x; not overlapping, 1.0x.
    rows = {row["run"]: row for row in validation.torchtitan()}
    for plain in ("8B, FSDP 8 x TP 8, local batch 12, per-op SAC, compiled",
                  "70B, FSDP 32 x TP 8, local batch 16, full AC, compiled"):
        overlapped = rows[plain + ", async TP"]
        gain = lambda row: estimate(row["job"], row["layout"]).tokens_per_s_per_gpu
        measured = overlapped["measured"] / rows[plain]["measured"]
        assert gain(overlapped) / gain(rows[plain]) == pytest.approx(measured, abs=0.02), plain


def test_overlapped_tp_hides_behind_its_matmuls_only_and_only_with_sequence_parallelism():
    from meshtrain.planning.step_time import overlapped_tp_seconds, step_time

    # Longer than what its matmuls can cover (all but one chunk in tp): the rest is exposed.
    assert overlapped_tp_seconds(10.0, 4.0, 8, 0.0) == pytest.approx(10.0 - 4.0 * 7 / 8)
    # Shorter: it all hides, and the matmuls beside it pay the SMs it holds.
    assert overlapped_tp_seconds(1.0, 100.0, 8, 0.1) == pytest.approx(0.1)
    assert overlapped_tp_seconds(1.0, 100.0, 8, 0.1, realised=0.5) == pytest.approx(0.5 + 0.05)

    row = next(r for r in validation.torchtitan() if r["run"].endswith("compiled, async TP"))
    plain = dataclasses.replace(row["job"], tp_overlap=0.0)
    full, none = step_time(dataclasses.replace(row["job"], tp_overlap=1.0), row["layout"]), step_time(plain, row["layout"])
    assert full.times["tp"] < 0.5 * none.times["tp"]
    assert full.comm_bytes["tp"] == none.comm_bytes["tp"]  # the same bytes, moved beside the matmuls
    # Without sequence parallelism TP all-reduces: nothing to pipeline into a matmul.
    no_sp = lambda j: step_time(dataclasses.replace(j, sequence_parallel=False), row["layout"]).seconds
    assert no_sp(dataclasses.replace(row["job"], tp_overlap=1.0)) == no_sp(plain)


def test_a_config_with_async_tp_is_planned_with_torchs_measured_overlap():
    from meshtrain.planning.estimate import estimate_config
    from meshtrain.planning.step_time import ASYNC_TP_HIDES
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.training.config_loader import load_config

    h100 = get_gpu("h100-80gb")
    plain = estimate_config(load_config("llama70b_2d", ["--compile.enable=true"]), 64, 8, h100)
    overlapped = estimate_config(load_config("llama70b_2d", ["--compile.enable=true", "--compile.async_tp=true"]),
                                 64, 8, h100)
    assert ASYNC_TP_HIDES < 1
    assert overlapped.times["tp"] < plain.times["tp"]
    assert overlapped.tokens_per_s_per_gpu > plain.tokens_per_s_per_gpu
    assert overlapped.memory.total == plain.memory.total


@pytest.mark.parametrize("ac, compiled", [("none", False), ("full", False), ("none", True)])
def test_a_plan_gathering_for_each_column_linear_makes_the_collectives_and_copies_counted(fake_world, ac, compiled):
    # KempnerForge's TP plan, built on meshtrain's Llama: no prepared input for attention and
    # the FFN, each of q, k, v, w1, w3 a ColwiseParallel of its own Shard(1) input. Torch then
    # gathers the sequence five times a block where the native plan gathers twice; the
    # planner's tp_collectives and tp_layout_copies with reductions (5, 2) count what it runs
    # (with the native plan's counts, 8 a block, this fails). Compiled (its blocks through
    # AOTAutograd, whose graphs run op by op under aot_eager, so the mode below sees them):
    # the forward's identical gathers merge, 11 a block, not 14 (counted eager, this fails).
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtrain.models.llama import Llama
    from meshtrain.parallel import ParallelDims, apply_ac
    from meshtrain.parallel.tensor_parallel import apply_tp
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.shape import Job, ModelShape
    from meshtrain.planning.shares import checkpointed_blocks, rank_shares
    from meshtrain.planning.step_time import tp_collectives, tp_layout_copies

    fake_world(2)
    torch.manual_seed(0)
    model = Llama.from_flavor("debug", vocab_size=512)
    plan = model.tp_plan(sequence_parallel=True)
    for name in model.layers:
        del plan[f"layers.{name}.attention"], plan[f"layers.{name}.feed_forward"]
        for linear in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{name}.{linear}"] = ColwiseParallel(input_layouts=Shard(1))
    apply_tp(model, init_device_mesh("cpu", (2,)), plan)
    apply_ac(model.transformer_blocks(), ac, every=2)
    micro_batch, seq, dim = 2, 64, model.cfg.dim
    whole, shapes = micro_batch * seq * dim, {(micro_batch, seq, dim), (2 * micro_batch, seq // 2, dim)}
    is_collective = lambda target, numels: (
        getattr(target, "namespace", "") == "_c10d_functional"
        and target.__name__.split(".")[0] in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
        and whole in numels())
    in_graphs = {"collectives": 0, "cats": 0}
    if compiled:
        # The blocks' graphs as inductor gets them (its partitioner, which runs AOTAutograd's
        # common-subexpression pass), counted each time one runs. A dispatch mode cannot
        # watch compiled code, so the embedding and the head (eager) are left to the others.
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from meshtrain.parallel.activation_checkpoint import apply_compile

        def counting(gm, _):
            nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
            numels = lambda n: {x.meta["val"].numel() for x in (n, *n.all_input_nodes) if "val" in x.meta
                                and isinstance(x.meta["val"], torch.Tensor)}
            found = {"collectives": sum(is_collective(n.target, lambda: numels(n)) for n in nodes),
                     "cats": sum(n.target is torch.ops.aten.cat.default and tuple(n.meta["val"].shape) in shapes
                                 for n in nodes)}
            graph = make_boxed_func(gm)

            def run(args):
                for key, count in found.items():
                    in_graphs[key] += count
                return graph(args)
            run._boxed_call = True
            return run

        apply_compile(model.transformer_blocks(), backend=aot_autograd(
            fw_compiler=counting, bw_compiler=counting, partition_fn=min_cut_rematerialization_partition))

    class ActivationTraffic(TorchDispatchMode):
        cats, collectives = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and tuple(out.shape) in shapes:
                self.cats += 1
            if is_collective(func, lambda: (args[0].numel(), out.numel())):
                self.collectives += 1
            return out

    step = lambda: model(torch.randint(0, 512, (micro_batch, seq))).float().logsumexp(-1).full_tensor().sum().backward()
    with contextlib.nullcontext(in_graphs) if compiled else ActivationTraffic() as seen:
        step()
    if compiled:
        seen = types.SimpleNamespace(**in_graphs)
    shape = ModelShape.from_model(model, flavor="debug", n_layers=model.cfg.n_layers, family="llama",
                                  learned_positions=False)
    job = Job(shape, get_gpu("h100-80gb"), 1, 2, seq, micro_batch)
    lay = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=1, world_size=2, strategy="FULL_SHARD", ac=ac,
                       micro_batch=micro_batch)
    (share,) = rank_shares(job, lay)
    ckpt = checkpointed_blocks(share, ac)
    per_linear = ((5, 2), (0, 0))
    ends = 2 * (share.first + share.last) if compiled else 0  # one gather and one scatter each, outside the graphs
    assert (seen.collectives + ends, 0) == tp_collectives(share, ckpt, 0, sequence_parallel=True, shared_experts=False,
                                                          reductions=per_linear, compiled=compiled)
    assert seen.cats + ends == tp_layout_copies(share, ckpt, micro_batch, per_linear, compiled)
    assert seen.collectives + ends > tp_collectives(share, ckpt, 0, sequence_parallel=True, shared_experts=False)[0]
