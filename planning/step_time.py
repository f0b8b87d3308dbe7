"""Step time of a layout: compute at kernel speeds (planning/kernels.py), the bytes each
mesh dimension sends per step and how much of it compute hides, the pipeline bubble from
torch's own schedule (planning/schedule.py), and the passes over the parameters. docs/planning.md derives
every term; docs/planning.md, Validation, says how far it is from measured steps.

Links are planning/hardware.py's: each collective costs NCCL's latency for its algorithm
plus its bytes over what its group gets of NVLink and of the node's NICs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshtrain.parallel.context_parallel import kv_repeats
from meshtrain.parallel.layout import ParallelDims
from meshtrain.parallel.vocabulary import WHOLE_BACKWARD
from meshtrain.planning import muon, param_passes
from meshtrain.planning.kernels import block_seconds, expert_seconds, head_seconds, loss_bytes_per_logit
from meshtrain.planning.memory import (BF16, expert_shard_degree, largest_unit, rank_params,
                                       rank_sharded_params)
from meshtrain.planning.schedule import makespan
from meshtrain.planning.shape import Job, ModelShape, forwards_per_step, keeps_gathered, replica_group, shard_degree
from meshtrain.planning.shares import checkpointed_blocks, checkpointed_moe_blocks, rank_shares

FLOAT8 = 1  # bytes per float8 element


def fsdp_rounds(lay: ParallelDims, job: Job) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of each FSDP unit per step.
    Reducing every micro-batch (no pipeline, gradient_sync = "microbatch"): every
    micro-batch gathers in forward (and again in backward with FULL_SHARD) and
    reduce-scatters its gradients.
    Reducing once a step (a pipeline, or gradient_sync = "step": no unit reshards after a
    backward until the last): SHARD_GRAD_OP gathers once per step; FULL_SHARD re-gathers
    after every forward, m + 1 times (the 3 + 2n measured in docs/pipeline.md for 2
    resharding units and 1 that is not); one reduce-scatter per step either way."""
    zero2 = keeps_gathered(lay)  # NO_SHARD too: gathered (cast) once, never resharded
    n = forwards_per_step(job, lay)
    if lay.reduces_once:
        return (1 if zero2 else n + 1), 1
    return (n if zero2 else 2 * n), n


@dataclass
class StepTime:
    seconds: float
    comm_bytes: dict[str, float]   # per GPU per step, sent, by mesh dimension
    times: dict[str, float]        # seconds per step: compute, tp, pp, bubble, fsdp, contention, fsdp_copies, clip, optimizer
    fsdp_comm_time: float          # all of FSDP's collectives, hidden or not
    compute_split: dict[str, float] = field(default_factory=dict)  # compute: matmul, attention, memory-bound


def step_time(job: Job, lay: ParallelDims) -> StepTime:
    """One step of ``lay``: compute on the slowest pipeline rank, the TP, PP and CP traffic
    on its critical path, the pipeline bubble, the FSDP traffic compute does not hide, and
    the optimizer."""
    m, gpu, s, b, t, cp = job.model, job.gpu, job.seq_len, lay.micro_batch, lay.tp, lay.cp
    n_mb = forwards_per_step(job, lay)
    shares = rank_shares(job, lay)
    act = BF16 * s // cp * b * m.dim         # one micro-batch's hidden states, this rank's tokens
    # The mesh is pp x dp_replicate x dp_shard x cp x tp: cp groups stride tp, FSDP's
    # (dp_shard x cp) too, replicas tp x dp_shard x cp.
    # (size, stride) of each dimension's groups; a collective's time is net.seconds' (latency
    # of NCCL's algorithm + bytes over NVLink / the node's NICs, planning/hardware.py).
    net = job.net
    # While a collective runs it holds collective_sms of the GPU's SMs (planning/hardware.py):
    # compute beside it, FSDP's or TP's, runs on the rest.
    slowdown = net.collective_sms / gpu.sms
    tp_g, cp_g, pp_g = (t, 1), (cp, t), (lay.pp, t * lay.dp * cp)
    ep_g = (lay.ep, t * cp)  # ep: neighbouring dp_shard ranks (parallel/expert_parallel.py)
    # NO_SHARD: no shard group (size 1, free); gradients all-reduced over every replica.
    dp_g, rep_g = (shard_degree(lay), t), replica_group(lay)

    per_mb, tp_bytes, pp_bytes, cp_bytes, ep_bytes, fsdp, parts = [], [], [], [], [], [], []
    # A mixture of experts: its MoE blocks' attention, router and shared experts as a block
    # (planning/kernels.py), their routed experts apart (expert_seconds).
    moe_block = dataclasses.replace(m, layer_split=m.moe_split, ffn_hidden=m.shared_hidden)
    ep = lay.ep
    # The busiest ep rank receives moe_imbalance x the mean token copies (Job.moe_imbalance).
    skew = job.moe_imbalance if ep > 1 else 1.0
    for share in shares:
        ckpt, ckpt_moe = checkpointed_blocks(share, lay.ac), checkpointed_moe_blocks(share, lay.ac)
        n_moe = share.moe_layers
        # Matmuls, attention and memory-bound work at their own speeds (planning/kernels.py);
        # this rank runs s / cp tokens of each of the micro-batch's b sequences.
        tokens = b * s / cp
        run = lambda shape, recompute: block_seconds(shape, tokens=tokens, seq=s, tp=t, cp=cp, gpu=gpu,
                                                     recompute=recompute, compiled=job.compiled, float8=job.float8,
                                                     attention_efficiency=job.attention_efficiency)
        kept = "op" if lay.ac == "op" else "none"
        seconds = (run(m, "full") * (ckpt - ckpt_moe) + run(m, kept) * (share.layers - n_moe - ckpt + ckpt_moe))
        if n_moe:
            # Every tp rank routes the same (whole) sequences: its experts see tokens x top_k
            # copies, not split by tp.
            experts = lambda recompute: expert_seconds(m, copies=tokens * m.top_k * skew, gpu=gpu,
                                                       recompute=recompute, compiled=job.compiled)
            seconds = seconds + run(moe_block, "full") * ckpt_moe + run(moe_block, kept) * (n_moe - ckpt_moe)
            tp_matmul = seconds.matmul  # the matmuls TP splits: not the routed experts'
            seconds = seconds + experts("full") * ckpt_moe + experts(kept) * (n_moe - ckpt_moe)
        else:
            tp_matmul = seconds.matmul
        if share.last:
            seconds = seconds + head_seconds(m, tokens=tokens, tp=t, gpu=gpu, loss_bytes=loss_bytes_per_logit(job),
                                             loss_parallel=job.loss_parallel)
        compute = seconds.total
        parts.append(seconds)
        # TP: the gathers, scatters and all-reduces of whole activations torch runs
        # (tp_collectives); each all-gather or reduce-scatter moves (t-1)/t of the activation
        # per GPU, an all-reduce twice that.
        n_gs, n_ar = (tp_collectives(share, ckpt, ckpt_moe, sequence_parallel=job.sequence_parallel,
                                     shared_experts=m.shared_hidden > 0, reductions=m.tp_reductions,
                                     compiled=job.compiled)
                      if t > 1 else (0, 0))
        tp_b = (n_gs + 2 * n_ar) * act * (t - 1) / t
        # Without loss_parallel the output layer all-gathers its bf16 logits over the
        # vocabulary (its backward only slices the whole gradient: no collective).
        logits = BF16 * tokens * m.vocab if share.last and t > 1 and not job.loss_parallel else 0.0
        tp_b += logits * (t - 1) / t
        # PP: each stage boundary sends the sequence-sharded activation forward and its
        # gradient back.
        sends = 2 * len(share.stage_layers) - share.first - share.last if lay.pp > 1 else 0
        pp_b = sends * act / t
        # CP: per block the four all-to-alls (q, k, v, out) run in forward, in backward, and
        # again for a recomputed block; each sends (cp-1)/cp of this rank's piece. They sit
        # between the projections and attention: on the critical path.
        n_a2a = 2 * share.layers + ckpt
        cp_in = cp_exchange_bytes(m, s, b, t, cp)
        cp_b = n_a2a * cp_in * (cp - 1) / cp
        cp_mb = 4 * n_a2a * net.seconds("all-to-all", cp_in / 4, *cp_g)
        if job.cp_kv_all_gather and cp > 1:
            # Llama 3's CP instead: each forward (and a recomputed block's again) all-gathers
            # the whole sequence's K and V of this TP rank's kv heads; backward
            # reduce-scatters their gradients. Queries never move.
            head_dim = m.head_dim or m.dim // m.n_heads
            kv_full = 2 * BF16 * s * b * max(m.kv_dim / t, head_dim)
            n_kv_ag, n_kv_rs = share.layers + ckpt, share.layers
            cp_b = (n_kv_ag + n_kv_rs) * kv_full * (cp - 1) / cp
            cp_mb = (n_kv_ag * net.seconds("all-gather", kv_full, *cp_g)
                     + n_kv_rs * net.seconds("reduce-scatter", kv_full, *cp_g))
        # EP, per MoE layer: dispatch and combine forward, their gradients backward, and the
        # forward's two again when the block is recomputed; each all-to-all takes this
        # rank's tokens x top_k copies of dim and keeps 1/ep of them (on average: the mean
        # over the ranks, for any routing). Each forward first exchanges the n_experts int64
        # counts. Between the router and the experts: on the critical path, and the busiest
        # rank receives `skew` x the mean.
        ep_in, counts = BF16 * tokens * m.top_k * m.dim, 8 * m.n_experts
        n_ep, n_counts = (4 * n_moe + 2 * ckpt_moe, n_moe + ckpt_moe) if ep > 1 else (0, 0)
        ep_b = (n_ep * ep_in + n_counts * counts) * (ep - 1) / ep
        recomputed = share.layers if lay.ac == "op" else ckpt  # op recomputes element-wise work: the copies too
        copies = (tp_layout_copies(share, recomputed, b, m.tp_reductions, job.compiled) if t > 1 and job.sequence_parallel
                  else 0)
        # Only gathers and scatters pipeline into a matmul (async TP needs sequence
        # parallelism); an all-reduce stays whole.
        gathers_scatters = n_gs * net.seconds("all-gather", act, *tp_g)
        if job.tp_overlap:
            gathers_scatters = overlapped_tp_seconds(gathers_scatters, tp_matmul, t, slowdown,
                                                     realised=job.tp_overlap)
        tp_mb = (gathers_scatters + n_ar * net.seconds("all-reduce", act, *tp_g)
                 + copies * 2 * act / gpu.hbm_bandwidth + (net.seconds("all-gather", logits, *tp_g) if logits else 0.0))
        per_mb.append((compute, tp_mb,
                       sends * net.seconds("send/recv", act / t, *pp_g),
                       cp_mb,
                       n_ep * net.seconds("all-to-all", ep_in * skew, *ep_g)
                       + n_counts * net.seconds("all-to-all", counts, *ep_g)))
        tp_bytes.append(tp_b * n_mb)
        pp_bytes.append(pp_b * n_mb)
        cp_bytes.append(cp_b * n_mb)
        ep_bytes.append(ep_b * n_mb)
        other, routed = rank_params(m, share, t, ep)
        if ep == 1:  # the experts are part of their block's unit, sharded with it
            other, routed = other + routed, 0.0
        fsdp.append((other + routed, other, routed, largest_unit(m, share, t, ep),
                     fsdp_unit_count(m, share), n_moe, rank_sharded_params(m, share, lay),
                     float8_gathered(job, share, t), share.layers))

    # The slowest pipeline rank sets the pace of every micro-batch.
    worst = max(range(len(shares)), key=lambda r: sum(per_mb[r]))
    compute, tp_time, pp_time, cp_time, ep_time = (x * n_mb for x in per_mb[worst])
    busy = compute + tp_time + pp_time + cp_time + ep_time
    # Bubble: play torch's own schedule out with this rank's times (planning/schedule.py),
    # a backward twice a forward; for 1F1B that is fill and drain, (pp - 1) micro-batches.
    bubble = 0.0
    if lay.pp > 1 and lay.pp_schedule in WHOLE_BACKWARD:
        # Each stage at its own time (the first also runs the embedding, the last the output
        # layer and loss; the split may be uneven), and each send between ranks -- latency plus
        # the activation's bytes -- as a delay on the schedule's timeline: one stage's
        # forward to the next stage's, one backward to the previous stage's.
        busy -= pp_time
        stage = stage_seconds(shares, [c + tp_ + cp_ + ep_ for c, tp_, _, cp_, ep_ in per_mb])  # all but sends
        hop = net.seconds("send/recv", act / t, *pp_g)
        run = lambda delay: makespan(lay.pp_schedule, lay.pp, lay.stages_per_rank, n_mb,
                                     [x / 3 for x in stage], [2 * x / 3 for x in stage], delay)
        still = run(0.0)
        pp_time, bubble = run(hop) - still, still - busy
    elif lay.pp > 1:
        bubble = busy * (lay.pp - 1) / lay.stages_per_rank / n_mb

    # FSDP on the rank with the most parameters. Ring collectives: each GPU sends (n-1)/n of
    # the unsharded bytes; gathers in bf16, reductions in the reduce dtype (fp32 unless
    # [training] mixed_precision_reduce says bfloat16: Job.reduce_bytes); HSDP all-reduces the shard.
    # Under ep the routed experts are FSDP units of their own, over the dp_shard / ep ranks
    # holding the same experts (stride tp x ep).
    _, local, routed, unit, n_units, n_moe, sharded, f8, layers = max(fsdp)
    (ds, _), (dr, _) = dp_g, rep_g
    de, ex_g = expert_shard_degree(lay), (expert_shard_degree(lay), t * ep)
    n_ag, n_rs = fsdp_rounds(lay, job)
    # Float8 all-gather: f8 of the local parameters gather at one byte, not two; the
    # largest unit saves its share when it is a dense block.
    saved = (BF16 - FLOAT8) * f8
    # FULL_SHARD without a pipeline gathers the embedding and the head unlike a block
    # (end_gathers): (parameters, gathers a step) of each.
    ends = end_gathers(m, lay, t, n_mb)
    once = sum(p for p, _ in ends)
    blocks_bytes = BF16 * (local - once) - saved
    ag = (n_ag * blocks_bytes + sum(k * BF16 * p for p, k in ends)) * (ds - 1) / ds  # per step
    # The copies around each gather go by parameters (float8's at the bf16 rates, param_passes).
    copy_ag = (n_ag * (local - once) + sum(k * p for p, k in ends)) / local
    # One dense block's parameters on this GPU, and the bytes a float8 gather saves on it.
    block = m.layer_split / t + m.layer_replicated
    block_saved = (BF16 - FLOAT8) * m.layer_split / t if f8 else 0.0
    unit_saved = block_saved if unit == block else 0.0
    red = job.reduce_bytes
    rs = red * local * (ds - 1) / ds
    ar = 2 * red * local / ds * (dr - 1) / dr
    ag_e, rs_e = BF16 * routed * (de - 1) / de, red * routed * (de - 1) / de
    # Each round runs one collective per FSDP unit (a block, the embedding, norm + output):
    # n_units collectives of the average unit (the latency is paid per collective).
    per_unit = local / n_units
    gather = lambda params, g=dp_g: net.seconds("all-gather", BF16 * params, *g)
    reduce = lambda params: (net.seconds("reduce-scatter", red * params, *dp_g)
                             + net.seconds("all-reduce", red * params / ds, *rep_g))
    round_ag = n_units * net.seconds("all-gather", (BF16 * local - saved) / n_units, *dp_g)
    round_rs = n_units * reduce(per_unit)
    gathers = n_ag * round_ag
    if ends:  # the blocks n_ag times, the embedding's and the head's units as end_gathers says
        blocks = m.n_layers  # no pipeline: this rank holds every block
        gathers = (n_ag * blocks * net.seconds("all-gather", blocks_bytes / blocks, *dp_g)
                   + sum(k * gather(p) for p, k in ends))
    if routed:
        gathers += n_ag * n_moe * gather(routed / n_moe, ex_g)
        round_rs += n_moe * net.seconds("reduce-scatter", red * routed / n_moe, *ex_g)
    fsdp_time = gathers + n_rs * round_rs
    first_gather = net.seconds("all-gather", BF16 * unit - unit_saved, *dp_g)
    # Overlap: FSDP2 prefetches, so its collectives hide behind compute except the first
    # unit's gather and the last unit's reduction of each round (the edges). Under a
    # pipeline the one reduce-scatter (+ HSDP all-reduce) runs after the last backward:
    # fully exposed. What overlaps compute is exposed only where it outlasts it.
    if lay.pp > 1:
        edges, overlapped = first_gather + round_rs, max(0.0, gathers - first_gather)
    elif lay.reduces_once:
        # gradient_sync = "step": the one reduction runs unit by unit during the last
        # micro-batch's backward (a third of its compute forward, two thirds backward), which
        # hides it up to that backward's length; the first unit's gather waits once a step
        # where units stay gathered (SHARD_GRAD_OP, NO_SHARD), once a micro-batch otherwise.
        waits = 1 if keeps_gathered(lay) else n_mb
        tail = max(0.0, round_rs - reduce(unit) - 2 * compute / (3 * n_mb))
        edges = waits * first_gather + reduce(unit) + tail
        overlapped = max(0.0, fsdp_time - edges)
    else:
        edges = n_mb * (first_gather + reduce(unit))
        overlapped = max(0.0, fsdp_time - edges)
    if not job.backward_prefetch and not keeps_gathered(lay):
        # FSDP1's BACKWARD_POST: a block's backward gather (FULL_SHARD's beyond each
        # forward's) is issued after the block behind it has its gradients, when nothing is
        # left to compute beside it; the reduce-scatter queued after it on the same NCCL
        # stream still hides behind the next block's backward.
        waiting = (n_ag - n_mb) * layers * net.seconds("all-gather", BF16 * block - block_saved, *dp_g)
        edges, overlapped = edges + waiting, max(0.0, overlapped - waiting)
    exposed = edges + max(0.0, overlapped - compute)
    # Hiding is not free: while a collective runs it holds collective_sms of the GPU's SMs
    # (planning/hardware.py) and the compute beside it runs on the rest, slowed by that
    # fraction for as long as the two overlap. The step grows only where the slowed compute
    # then outlasts the traffic.
    contention = max(0.0, compute + slowdown * overlapped - max(overlapped, compute))
    # Passes over the parameters, memory-bound (planning/param_passes.py): FSDP2's copies
    # around its collectives, the gradient norm and clipping, AdamW.
    # Gradients, clipping and AdamW cover the trained parameters only ([lora]: the adapters),
    # AdamW not Muon's matrices (job.muon: their fraction of the trained ones).
    # The routed experts, under ep, are units of their own over de ranks, dividing their
    # gradients by a factor of their own (parallel/fsdp.py).
    passes = dict(trainable=job.trainable, microbatches=n_mb, reduces_once=lay.reduces_once, reduce_bytes=red)
    copies = (param_passes.fsdp_copy_bytes(local, ds, (copy_ag, n_rs), **passes)
              + (param_passes.fsdp_copy_bytes(routed, de, (n_ag, n_rs), divided=True, **passes) if routed else 0.0)
              ) / gpu.hbm_bandwidth
    clip = param_passes.clip_bytes(sharded * job.trainable, job.clip) / gpu.hbm_bandwidth
    optimizer = param_passes.adamw_bytes(sharded * job.trainable * (1 - job.muon)) / gpu.hbm_bandwidth
    # Muon (planning/muon.py): Newton-Schulz on the whole matrices this rank owns and the
    # all-to-alls that bring them and take them back, after the backward: all exposed.
    # On the pipeline rank with the most layers (the others wait for it at the next step).
    muon_bytes, muon_time = {}, 0.0
    if job.muon_shapes:
        most = max(shares, key=lambda sh: sh.layers)
        muon_bytes, a2a_time = muon.all_to_all(job, lay, most)
        muon_time = muon.compute_seconds(job, lay, most) + a2a_time

    step = busy + bubble + exposed + contention + copies + clip + optimizer + muon_time
    return StepTime(
        seconds=step,
        comm_bytes={"dp_shard": ag + n_rs * rs, "dp_replicate": n_rs * ar,
                    "tp": max(tp_bytes), "pp": max(pp_bytes), **({"cp": max(cp_bytes)} if cp > 1 else {}),
                    **({"ep": max(ep_bytes), "dp_shard_mod_ep": n_ag * ag_e + n_rs * rs_e} if ep > 1 else {}),
                    **{f"muon_{d}": b for d, b in muon_bytes.items()}},
        times={"compute": compute, "tp": tp_time, "pp": pp_time, **({"cp": cp_time} if cp > 1 else {}),
               **({"ep": ep_time} if ep > 1 else {}),
               "bubble": bubble, "fsdp": exposed, "contention": contention, "fsdp_copies": copies, "clip": clip, "optimizer": optimizer, **({"muon": muon_time} if job.muon_shapes else {})},
        fsdp_comm_time=fsdp_time,
        compute_split={k: getattr(parts[worst], k) * n_mb for k in ("matmul", "attention", "memory")})


# Of what overlapped_tp_seconds could hide, the share torch's async TP ([compile] async_tp:
# inductor's micro-pipeline TP) does, from torchtitan's measurement of it
# (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, bf16, the same layouts without and
# with it): 1.10x for Llama 3 8B at FSDP 8 x TP 8, 1.09x for 70B at FSDP 32 x TP 8, where
# hiding all of it would give 1.28x and 1.22x: 0.42 and 0.47 of it. Transformer Engine's
# overlap (Megatron's --tp-comm-overlap, NeMo's ub_tp_comm_overlap) is planned as hiding all
# of it (1.0): NVIDIA's rows come out within 15% that way (docs/planning.md, Validation).
ASYNC_TP_HIDES = 0.45


def overlapped_tp_seconds(collectives: float, matmul: float, tp: int, slowdown: float, realised: float = 1.0) -> float:
    """What ``collectives`` seconds of TP all-gathers and reduce-scatters cost when each is
    pipelined with the matmul it feeds or follows, as async TP does (torch's micro-pipeline
    TP under [compile] async_tp; Megatron's --tp-comm-overlap, Transformer Engine's
    ub_tp_comm_overlap). The matmul is cut into tp chunks, one per rank's piece: the piece
    a rank holds computes first while the next one moves, and a reduce-scatter sends each
    chunk's partial sum while the next chunk computes. So all but one chunk in tp of the
    block's matmuls (``matmul`` seconds) can have a transfer beside it; what does not fit
    beside them stays exposed, and what hides slows the chunks it runs beside by the share
    of SMs a collective holds (``slowdown``, as FSDP's overlap). ``realised``: the share
    of that an implementation achieves (ASYNC_TP_HIDES for torch's). Not counted: the
    smaller chunks' lower matmul efficiency (planning/matmul.py has one tile size; a
    chunk-timed model of it was tried and rejected, docs/planning.md)."""
    hidden = realised * min(collectives, matmul * (tp - 1) / tp)
    return collectives - hidden + slowdown * hidden


def tp_collectives(share, recomputed: int, recomputed_moe: int, *, sequence_parallel: bool,
                   shared_experts: bool, reductions: tuple = (), compiled: bool = False) -> tuple[int, int]:
    """(all-gathers + reduce-scatters, all-reduces) of a whole activation that one
    micro-batch's forward and backward run on this rank, as the models' TP plans make them
    (counted on torch: tests/test_step_time.py).

    With sequence parallelism (the native plans) a dense block gathers before attention and
    the FFN and scatters after each, forward, and the reverse in backward: 8. A MoE block's
    FFN runs whole on every tp rank (the routed experts are not split by tp): it gathers
    its input and cuts its output back to a sequence shard locally, and its input gradient
    is whole on every rank, so nothing of it is scattered: 6. Shared experts (w1 and w3 by
    columns, w2 by rows) add an all-reduce forward and two backward, one per column-split
    input.

    Without it, a row-split Linear all-reduces its output in forward, and a column-split
    one its input gradient in backward; the native plans prepare attention's and the FFN's
    input as one DTensor, so q, k and v (w1 and w3) share one: (2, 2) per dense block.
    ``reductions``, ((column, row) of a dense block, of a MoE block), is a plan whose every
    Linear reduces alone (Hugging Face models': (5, 2) for a Llama-like block). With
    sequence parallelism such a plan (KempnerForge's: each column-split Linear takes its own
    Shard(1) input) gathers the sequence for each column-split Linear and scatters after
    each row-split one, and the reverse in backward: 2 (column + row) a dense block, 14 for
    Llama's (5, 2), where the native plans' one prepared input makes 8; a recomputed block
    runs all of its forward's again but the last scatter. Compiled (``compiled``), the
    forward's gathers of one input are one: AOTAutograd's common-subexpression pass
    (fx_graph_cse, before the partitioner) merges identical functional all-gathers, so q, k
    and v (w1 and w3) share a gather as under the native plans, 2 a dense block, while
    backward still reduce-scatters each Linear's own input gradient (c): 11 for (5, 2), a
    recomputed block 3 more (counted on torch's compiled graphs: tests/test_step_time.py;
    the recomputation argued, torch 2.13 refusing to compile that checkpointed region under
    TP, parallel/compose.py). The embedding and the output
    layer: one each way. Not counted: the all-gathers some Hugging Face plans
    add (a fused qkv's output, q/k norms over the whole width), GPT-2's position embedding.

    A recomputed block (AC full; selective's wrapped ones) runs its forward again, but
    torch's checkpoint stops once the last tensor backward needs is rebuilt: before a dense
    block's final scatter or all-reduce, while a MoE block's experts come after every one of
    its forward collectives. AC op saves every collective's output: nothing again."""
    moe, dense = share.moe_layers, share.layers - share.moe_layers
    ends, shared = share.first + share.last, int(shared_experts)
    if sequence_parallel:
        c, r, c_forward = dense_block_linears(reductions, compiled)
        return ((c_forward + r + c + r) * dense + 6 * moe + 2 * ends
                + (c_forward + r - 1) * (recomputed - recomputed_moe) + 3 * recomputed_moe), (3 * moe + recomputed_moe) * shared
    (col, row), (moe_col, moe_row) = reductions or ((2, 2), (1 + 2 * shared, 1 + shared))
    return 0, (dense * (col + row) + moe * (moe_col + moe_row) + ends
               + (recomputed - recomputed_moe) * (row - 1) + recomputed_moe * moe_row)


def dense_block_linears(reductions: tuple, compiled: bool) -> tuple[int, int, int]:
    """(column-split Linears reducing alone, row-split ones, the forward's sequence gathers)
    of a dense block's TP plan: the native plans' (2, 2), or ``reductions``' first pair. Compiled,
    the gathers of one input merge (tp_collectives): one for attention's, one for the FFN's."""
    c, r = reductions[0] if reductions else (2, 2)
    return c, r, (min(c, 2) if compiled else c)


def tp_layout_copies(share, recomputed: int, micro_batch: int, reductions: tuple = (), compiled: bool = False) -> int:
    """Copies of a whole activation around TP's sequence-parallel collectives per micro-batch
    on this rank, each read and written once, on the critical path with the collectives.
    Activations are [batch, seq, dim] and SP shards the sequence (dim 1), but NCCL gathers
    and scatters along dim 0, so torch's functional collectives
    (torch/distributed/_functional_collectives.py) rearrange: a reduce-scatter copies its
    whole input into rank order (`_chunk_or_narrow_cat`), an all-gather its whole output back
    into place unless the micro-batch is one sequence (then a view does). Counted on torch
    (tests/test_step_time.py): per block 4 of each kind (forward and backward), the
    embedding and the head one of each; a recomputed block (AC full, and op, whose policy
    saves the collectives' outputs but not the copies) 1 more reduce-scatter copy and 2 more
    all-gather ones; a MoE block's feed-forward returns to sequence shards by a local chunk,
    2 reduce-scatter copies fewer. A plan gathering for each column-split Linear
    (``reductions``, tp_collectives) copies around each of its collectives: (column + row)
    of each kind a dense block, a recomputed one row - 1 more scatter and column more
    gathers; compiled, its forward's gathers merged as tp_collectives says, 2 of them.
    (Megatron-LM keeps activations sequence-first, [seq, batch, dim], and has none of
    them.)"""
    ends, moe = share.first + share.last, share.moe_layers
    c, r, c_forward = dense_block_linears(reductions, compiled)
    scatters = (c + r) * (share.layers - moe) + 2 * moe + ends + (r - 1) * recomputed
    gathers = (c_forward + r) * (share.layers - moe) + 4 * moe + ends + c_forward * recomputed
    return scatters + (gathers if micro_batch > 1 else 0)


def fsdp_unit_count(m: ModelShape, share) -> int:
    """FSDP units of one GPU of this pipeline rank (models/common.py fsdp_units): each block,
    the embedding, the head; tied embedding and head on the same stage are one unit."""
    return share.layers + share.first + share.last - (m.tied and share.first and share.last)


def end_gathers(m: ModelShape, lay: ParallelDims, tp: int, n_mb: int) -> tuple[tuple[float, int], ...]:
    """(parameters of one GPU, all-gathers a step) of each unit that, without a pipeline, is
    gathered unlike a block; () where every unit is gathered as ``fsdp_rounds`` says.
    parallel/fsdp.py never reshards the last unit (the head) after its forward, since its
    backward comes next, and never gathers the embedding's table for a backward that needs
    only the token ids. So FULL_SHARD reducing every micro-batch gathers each once a
    micro-batch where it gathers a block twice (untied: two units; tied: one holding both).
    Reducing once a step (gradient_sync = "step"): FULL_SHARD gathers a block m + 1 times
    and the embedding once a micro-batch (its forward); SHARD_GRAD_OP and NO_SHARD each unit
    once; and either gathers the head twice, FSDP2 gathering it again in the last
    micro-batch. As the dry run traces them (tests/test_dry_run.py); a tied unit, whose table
    the head's backward needs, is counted there as a block. One micro-batch a step holds
    nothing: it is gathered as reducing every micro-batch."""
    held = lay.reduces_once and n_mb > 1
    if lay.pp > 1 or (keeps_gathered(lay) and not held):
        return ()
    head = (0 if m.tied else m.head_split / tp) + m.head_replicated
    if m.tied:
        return () if held else ((m.embedding / tp + head, n_mb),)
    if held:
        return ((m.embedding / tp, 1 if keeps_gathered(lay) else n_mb), (head, 2))
    return ((m.embedding / tp, n_mb), (head, n_mb))


def float8_gathered(job: Job, share, tp: int) -> float:
    """Parameters of one GPU of this pipeline rank that FSDP gathers in float8 under
    [float8] enable_fsdp_float8_all_gather: the dense blocks' Linear weights (/ tp), which
    parallel/float8.py converts when their sizes are multiples of 16. Embeddings, norms,
    biases, the output layer (never converted) and MoE blocks (not modelled) gather in bf16."""
    m = job.model
    if not (job.float8 and job.float8_all_gather) or any(x % 16 for x in (m.dim, m.kv_dim, m.ffn_hidden)):
        return 0.0
    return (share.layers - share.moe_layers) * m.layer_split / tp


def stage_seconds(shares, per_rank: list[float]) -> list[float]:
    """Seconds of one micro-batch through each stage, by global stage index, from each pp
    rank's time for all its stages (``per_rank``). One stage per rank: its rank's. Several:
    the rank's time split by their layers (the embedding's and the output layer's time
    spread over the rank's stages with them)."""
    out = [0.0] * shares[0].n_stages
    for share, seconds in zip(shares, per_rank):
        for sid, layers in zip(share.stage_ids, share.stage_layers):
            out[sid] = seconds * layers / share.layers
    return out


def cp_exchange_bytes(m: ModelShape, s: int, b: int, t: int, cp: int) -> float:
    """Bytes one block's four all-to-alls take in, on one rank: q and the attention output
    at query width, k and v at kv width (repeated when a TP rank's kv heads do not split
    over cp; parallel.context_parallel.kv_repeats), for seq / cp tokens, bf16."""
    if cp == 1:
        return 0.0
    head_dim = m.head_dim or m.dim // m.n_heads
    repeats = kv_repeats(m.n_heads // t, m.kv_dim // head_dim // t, cp)
    return BF16 * s // cp * b * (2 * m.n_heads * head_dim + 2 * m.kv_dim * repeats) / t
