"""Peak memory per GPU of a layout: FSDP2's model states, the activations autograd keeps
and the gathered parameters and unsharded gradients alive at the step's worst moment.
docs/planning.md derives every term.

Activations come from a traced probe of two blocks (planning/activations.py) where the
family can build one, from closed forms of a Llama-shaped block otherwise. These are
estimates to *rank* layouts, not predictions: they count what autograd, FSDP2 and the
pipeline schedules of this code base keep alive, and ignore allocator fragmentation and
CUDA/NCCL workspaces (the headroom of physics/gpus.py is for those). A dry run
(`meshtrain dry-run`) measures the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.parallel.layout import ParallelDims
from meshtrain.planning import muon
from meshtrain.planning.activations import ProbeKey, activation_profile, probe_key
from meshtrain.planning.kernels import gated
from meshtrain.planning.schedule import replayed_actions
from meshtrain.planning.shape import Job, ModelShape, keeps_gathered, rank_batch, shard_degree
from meshtrain.planning.shares import RankShare, checkpointed_blocks, checkpointed_moe_blocks, rank_shares
from meshtrain.training import chunked_loss

BF16, FP32 = 2, 4


# ---------------------------------------------------------------- the ZeRO paper's accounting

def zero_model_states(psi: float, n_d: int, stage: str, k: int = 12) -> float:
    """Model-state bytes per GPU in Rajbhandari et al. 2019 (Fig. 1): fp16 params (2Ψ) and
    grads (2Ψ), and K·Ψ of optimizer state (fp32 master params, Adam m and v: K = 12).
    stage: "baseline" (plain DP), "os" (P_os), "os+g" (P_os+g), "os+g+p" (P_os+g+p)."""
    return {"baseline": (2 + 2 + k) * psi,
            "os": 2 * psi + 2 * psi + k * psi / n_d,
            "os+g": 2 * psi + (2 + k) * psi / n_d,
            "os+g+p": (2 + 2 + k) * psi / n_d}[stage]


def fsdp2_model_states(n_params: float, dp_shard: int) -> dict[str, float]:
    """Ours: FSDP2 keeps fp32 sharded params (the master copy), fp32 sharded grads
    (reduce dtype fp32) and AdamW's m and v, all sharded: 16 bytes/param / dp_shard.
    The bf16 copies exist only while a unit is gathered (see `transient_bytes`)."""
    return {"params": FP32 * n_params / dp_shard, "grads": FP32 * n_params / dp_shard,
            "optimizer": 2 * FP32 * n_params / dp_shard}


# ---------------------------------------------------------------- closed forms of one block

def layer_activation_bytes(m: ModelShape, s: int, b: int, t: int, sequence_parallel: bool = True) -> float:
    """Bytes autograd saves for one of *our* blocks' backward (bf16 compute; RMSNorm, GQA
    through SDPA/flash, SwiGLU; sequence parallel when t > 1, as in models/llama/tp_plan.py):
      full length (SP all-gathers the normed input; the q/k/v and w1/w3 matmuls save the
      gathered tensor, once per sub-block):                           2 x 2sbh
      sequence-sharded: attention_norm and ffn_norm inputs            2 x 2sbh/t
      q after rotary, attention output (= wo input)                   2 x 2sbh/t
      k, v at kv width (GQA)                                          2 x 2sb·kv/t
      SwiGLU: w1 out, silu out, w3 out, their product (= w2 input)    4 x 2sb·f/t
        (a GeLU MLP, two matrices: fc out, GeLU out (= proj input)      2 x 2sb·f/t)
      SDPA's fp32 log-sum-exp per head                                4sb·a/t
    Flash attention keeps no s x s matrix; rotary saves only its angles (a view of the model's table).
    Without sequence parallelism (``[parallelism] sequence_parallel = false``, and every
    Hugging Face plan) each rank holds the whole sequence between the sub-blocks: the norm
    inputs are full length too."""
    h, f, kv, a = m.dim, m.ffn_hidden, m.kv_dim, m.n_heads
    ffn = 4 if gated(m) else 2
    norms = BF16 * 2 * h / (t if sequence_parallel else 1)
    return s * b * (BF16 * 2 * h + norms + (BF16 * (2 * h + 2 * kv + ffn * f) + FP32 * a) / t)


def block_input_bytes(m: ModelShape, s: int, b: int, t: int, sequence_parallel: bool = True) -> float:
    """What a checkpointed block keeps: its input, sequence-sharded (2sbh/t), or whole
    without sequence parallelism (2sbh)."""
    return BF16 * s * b * m.dim / (t if sequence_parallel else 1)


def rank_params(m: ModelShape, share: RankShare, tp: int, ep: int = 1) -> tuple[float, float]:
    """(other, expert) parameters one GPU of this pipeline rank holds after TP and EP, before
    FSDP shards them. Routed experts are replicated over TP (every tp rank routes the same
    tokens) and split over ep: n_experts / ep whole experts per MoE layer."""
    dense, moe = share.layers - share.moe_layers, share.moe_layers
    n = dense * (m.layer_split / tp + m.layer_replicated) + moe * (m.moe_split / tp + m.moe_replicated)
    if share.first:
        n += m.embedding / tp
    if share.last:  # tied: the last stage holds its own copy, unless it is also the first
        n += (0 if m.tied and share.first else m.head_split / tp) + m.head_replicated
    return n, moe * m.expert_params / ep


def rank_local_params(m: ModelShape, share: RankShare, tp: int, ep: int = 1) -> float:
    """Parameters one GPU of this pipeline rank holds after TP (and EP), before FSDP shards them."""
    return sum(rank_params(m, share, tp, ep))


def expert_shard_degree(lay: ParallelDims) -> int:
    """Ranks FSDP shards the routed experts over: dp_shard / ep under expert parallelism
    (parallel/expert_parallel.py; ep refuses cp and HSDP), the usual degree without."""
    return shard_degree(lay) // lay.ep


def rank_sharded_params(m: ModelShape, share: RankShare, lay: ParallelDims) -> float:
    """Parameters one GPU's FSDP shards hold: the others over dp_shard (x cp), this rank's
    n_experts / ep experts over dp_shard / ep."""
    other, experts = rank_params(m, share, lay.tp, lay.ep)
    return other / shard_degree(lay) + experts / expert_shard_degree(lay)


def block_unit(m: ModelShape, share: RankShare, tp: int, ep: int = 1) -> float:
    """The largest block unit FSDP gathers on this rank: a dense block, or an MoE block
    with its n_experts / ep experts (a unit of their own under ep, gathered with it)."""
    units = [m.layer_split / tp + m.layer_replicated] if share.layers > share.moe_layers else []
    if share.moe_layers:
        units.append(m.moe_split / tp + m.moe_replicated + m.expert_params / ep)
    return max(units or [0.0])


def largest_unit(m: ModelShape, share: RankShare, tp: int, ep: int = 1) -> float:
    """The biggest FSDP unit on this rank (a block, the embedding, or norm + output)."""
    units = [block_unit(m, share, tp, ep)]
    if share.first:
        units.append(m.embedding / tp)
    if share.last:
        units.append(m.head_split / tp + m.head_replicated)
    return max(units)


def expert_activation_bytes(m: ModelShape, seq: int) -> float:
    """What one MoE layer keeps for backward per sequence of ``seq`` tokens (this rank's, the
    whole sequence under TP) that grows with the token copies its experts receive: each
    copy's input (dim; saved by the w1 and w3 matmuls) and its SwiGLU tensors (w1 and w3
    outputs, SiLU output, product: 4 x moe_hidden), bf16. Routing imbalance adds
    (imbalance - 1) x this on the busiest ep rank (Job.moe_imbalance)."""
    return BF16 * seq * m.top_k * (m.dim + 4 * m.moe_hidden)


# ---------------------------------------------------------------- the peak

@dataclass
class Memory:
    params: float = 0.0       # fp32 shards
    grads: float = 0.0        # fp32 shards
    optimizer: float = 0.0    # AdamW m, v (fp32 shards)
    activations: float = 0.0  # saved for backward, backward workspace, logits and loss
    transient: float = 0.0    # gathered bf16 params, unsharded grads, reduce-scatter buffers
    pp_rank: int = 0          # the pipeline rank these numbers are for

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient


def transient_bytes(m: ModelShape, share: RankShare, lay: ParallelDims, red: int = FP32) -> float:
    """FSDP2's unsharded state at the peak.
    No pipeline, FULL_SHARD / HYBRID_SHARD: two units gathered in bf16 (the one running and
      the one prefetched) and, in backward, one unit's bf16 gradient with its fp32 copy for
      the reduce-scatter: (2 + 2 + 2 + 4) x largest unit.
    No pipeline, SHARD_GRAD_OP / HYBRID_SHARD_ZERO2: every unit stays gathered from its
      forward to its backward, so the whole local model in bf16, plus the gradient buffers.
    Pipeline, any strategy: torch's PipelineStage turns off resharding after backward and
      gradient sync until the step's last backward, so the whole stage stays gathered (bf16)
      and its gradients accumulate unsharded in the fp32 reduce dtype until the one
      reduce-scatter per step: 2 + 4 bytes per local param, plus one unit's bf16 gradient.
      gradient_sync = "step" without a pipeline does the same (parallel/fsdp.py hold_gradients).
    ``red``: the reduce dtype's bytes (Job.reduce_bytes), each 4 above that is its (the
      reduce-scatter's input, the held sums) 2 under a bf16 reduction."""
    local, unit = rank_local_params(m, share, lay.tp, lay.ep), largest_unit(m, share, lay.tp, lay.ep)
    if lay.reduces_once:
        return (BF16 + red) * local + BF16 * unit
    if keeps_gathered(lay):  # ZeRO-2 (and NO_SHARD): kept gathered from forward to backward
        return BF16 * local + (BF16 + red) * unit
    return (2 * BF16 + BF16 + red) * unit


def probe_of(job: Job, lay: ParallelDims) -> ProbeKey | None:
    """The activation probe a layout's memory reads (planning/activations.py); None for a
    family without one (its activations come from formulas)."""
    # A compiled loss keeps what the chunked one keeps, the bf16 logits (the partitioner saves
    # them and two fp32 numbers per row), and its backward writes their bf16 gradient from
    # fused kernels: traced as the chunked loss, whose one fp32 chunk is the difference.
    return probe_key(job.model, job.seq_len // lay.cp, lay.tp, lay.ac, job.lora, job.chunked_loss or job.compiled_loss,
                     sequence_parallel=job.sequence_parallel, loss_parallel=job.loss_parallel, compiled=job.compiled)


def memory_per_gpu(job: Job, lay: ParallelDims) -> Memory:
    """Peak bytes per GPU on the worst pipeline rank (the one with the largest total).
    Activations come from a traced probe of two blocks (planning/activations.py) where the
    family can build one; otherwise from the formulas above."""
    key = probe_of(job, lay)
    prof = None if key is None else activation_profile(key)
    worst = None
    for r, share in enumerate(rank_shares(job, lay)):
        if prof is not None:
            mem = traced_memory(job, lay, r, share, prof)
        else:
            mem = Memory(pp_rank=r, **fsdp2_model_states(rank_sharded_params(job.model, share, lay), 1))
            mem.grads, mem.optimizer = mem.grads * job.trainable, mem.optimizer * job.trainable  # LoRA: frozen base
            mem.activations, mem.transient = formula_activations(job, lay, share), transient_bytes(job.model, share, lay, job.reduce_bytes)
        if worst is None or mem.total > worst.total:
            worst = mem
    return worst


def _units(m: ModelShape, tp: int) -> tuple[float, float]:
    """Local parameters of the embedding and the head (final norm + output)."""
    return m.embedding / tp, (m.head_split if not m.tied else m.embedding) / tp + m.head_replicated


def traced_memory(job: Job, lay: ParallelDims, rank: int, share: RankShare, prof) -> Memory:
    """Pipeline rank ``rank``'s peak from the probe's per-sequence bytes and FSDP2's rules,
    as the largest of the moments of its step.

    No pipeline: the loss's backward (every block's activations and the head's kept, the
    loss's working set, the head gathered); a block's backward (its recomputation and
    gradients on top of what is kept; two blocks gathered, its gradient in bf16 and its
    fp32 copy for the reduce-scatter); the end of the forward (the loss's fp32 copies);
    the embedding's backward (every sharded gradient made). SHARD_GRAD_OP keeps every unit
    gathered from its forward to its backward. Sharded fp32 gradients exist from the
    step's first backward on only with gradient accumulation (train_step frees them).

    Pipeline: each micro-batch of a stage keeps its input, its blocks and (last stage) the
    head; torch's schedule says which are in flight at each of the rank's backwards. As
    torch's PipelineStage turns resharding after backward and gradient reduction off
    until the step's last backward, a stage stays gathered (bf16) and its unsharded
    gradients accumulate in fp32 from its first backward on."""
    m, b, t = job.model, lay.micro_batch, lay.tp
    embed, head = _units(m, t)
    block = block_unit(m, share, t, lay.ep)  # an MoE block gathers its n_experts / ep experts
    local = rank_local_params(m, share, t, lay.ep)
    # Sharded over dp_shard (1 under NO_SHARD: every rank holds whole model states); under
    # ep the experts' shards are over dp_shard / ep, each of n_experts / ep experts.
    sharded = rank_sharded_params(m, share, lay)
    # With [lora] (job.trainable < 1) only the adapters have gradients and AdamW moments;
    # with Muon its share of them (job.muon) keeps one moment, not two (spread evenly over
    # the stages: the first and last hold more AdamW-only embedding and head).
    grad, red = job.trainable, job.reduce_bytes  # red: the reduce dtype's bytes (Job.reduce_bytes)
    mem = Memory(pp_rank=rank, params=FP32 * sharded, optimizer=(2 - job.muon) * FP32 * sharded * grad)
    zero2 = keeps_gathered(lay)
    accumulating = rank_batch(job, lay) > lay.local_batch
    held_grads = FP32 * sharded * grad if accumulating else 0.0
    gathered = lambda *units: BF16 * (local if zero2 else sum(units))
    # Muon's step (planning/muon.py): the sharded gradients, and what it stacks, gathers
    # and orthogonalises (SHARD_GRAD_OP and NO_SHARD still hold the gathered bf16 weights).
    muon_step = (FP32 * sharded * grad, muon.step_transient(job, lay, share) + (BF16 * local if zero2 else 0.0), 0.0)
    # Routing imbalance: the busiest ep rank's experts keep more token copies (Job.moe_imbalance).
    skew = (job.moe_imbalance - 1) * expert_activation_bytes(m, job.seq_len // lay.cp) if lay.ep > 1 else 0.0
    if lay.pp == 1:
        kept_moe = share.moe_layers - checkpointed_moe_blocks(share, lay.ac)
        kept = b * (prof.embed + prof.kept(share.layers) + kept_moe * skew)
        working = b * (prof.block_working + (skew if share.moe_layers else 0.0))
        # gradient_sync = "step": from the first micro-batch's backward on, every unit's
        # gradient sum is held unsharded in fp32 (beside it, the bf16 gradient a unit's
        # backward makes before adding it in: the largest unit's), and no unit reshards after
        # its backward, so a held backward ends with the whole local model gathered
        # (FULL_SHARD too).
        once = lay.reduces_once and accumulating
        if once:
            held_grads = (red * local + BF16 * max(head, block)) * grad
        moments = [  # (gradients, transient, activations)
            (held_grads, gathered(head), kept + b * (prof.head + prof.head_working)),
            (held_grads, gathered(block, block) + (BF16 + red) * block * grad, kept + working),
            (held_grads, gathered(head), kept + b * (prof.head + prof.forward_extra)),
            ((red * local if once else FP32 * sharded) * grad,
             (BF16 * local if once else gathered(embed)) + (BF16 + red) * embed * grad,
             b * (prof.embed + prof.kept(1))),
            muon_step,
        ]
        mem.grads, mem.transient, mem.activations = max(moments, key=sum)
        return mem
    weight, working, after, running = {}, {}, {}, {}
    dense_block, moe_block = m.layer_split / t + m.layer_replicated, m.moe_split / t + m.moe_replicated + m.expert_params / lay.ep
    for s, n, n_moe in zip(share.stage_ids, share.stage_layers, share.stage_moe):
        first, last = s == 0, s == share.n_stages - 1
        one = RankShare((n,), first, last, 0, 0, stage_moe=(n_moe,))
        kept_moe = n_moe - checkpointed_moe_blocks(one, lay.ac)
        weight[s] = b * ((prof.embed if first else prof.stage_input) + prof.kept(n) + kept_moe * skew
                         + (prof.head if last else 0))
        working[s] = b * max(prof.block_working + (skew if n_moe else 0), prof.head_working if last else 0)
        params = (n - n_moe) * dense_block + n_moe * moe_block + first * embed + last * (0 if (m.tied and first) else head)
        after[s] = red * params * grad + (0 if zero2 else BF16 * params)
        running[s] = 0 if zero2 else BF16 * (head if last else (moe_block if n_moe else dense_block))
    actions = replayed_actions(lay.pp_schedule, lay.pp, lay.stages_per_rank, lay.pp_microbatches, rank)
    live, done, best = {s: 0 for s in weight}, set(), (-1.0, 0.0, 0.0)
    for a in actions:
        if a.kind == "F":
            live[a.stage] += 1
            continue
        acts = sum(live[s] * weight[s] for s in live) + working[a.stage]
        transient = sum(after[s] for s in done) + (running[a.stage] if a.stage not in done else 0)
        if acts + transient > sum(best[1:]):
            best = (0.0, transient, acts)
        live[a.stage] -= 1
        done.add(a.stage)
    mem.grads = held_grads
    mem.transient = best[1] + gathered()
    mem.activations = best[2]
    if sum(muon_step) > mem.grads + mem.transient + mem.activations:
        mem.grads, mem.transient, mem.activations = muon_step
    return mem


def formula_activations(job: Job, lay: ParallelDims, share: RankShare) -> float:
    """The closed forms (a Llama-shaped block): for families the probe cannot build."""
    # Under context parallelism every activation holds this rank's seq / cp tokens (the
    # all-to-alls trade tokens for heads: q, k, v keep their bytes).
    m, s, b, t = job.model, job.seq_len // lay.cp, lay.micro_batch, lay.tp
    sp = job.sequence_parallel
    full, kept = layer_activation_bytes(m, s, b, t, sp), block_input_bytes(m, s, b, t, sp)
    ckpt = checkpointed_blocks(share, lay.ac) / share.layers
    # Saved for backward by the micro-batches in flight: a checkpointed block keeps only
    # its input. Plus the working set of one block's backward: its gradients (and, when
    # it was checkpointed, its recomputed activations).
    saved = share.inflight * (ckpt * kept + (1 - ckpt) * full)
    working = (2 if lay.ac != "none" else 1) * full
    if share.last:
        # The final norm's input and gathered output per micro-batch in flight. The loss
        # (loss_parallel, fp32, on the local vocab shard) keeps its fp32 log-softmax for
        # backward; its peak is in backward: that log-softmax, the incoming gradient and
        # the one produced, 3 x 4 bytes per logit (forward peaks lower, at 2 + 4 + 4).
        # [training] chunked_loss keeps the bf16 logits instead, and its backward peaks at
        # them, their bf16 gradient and one chunk's fp32 softmax. Without loss_parallel the
        # output layer gathers the whole vocabulary's logits on every tp rank.
        logits = s * b * m.vocab / (t if job.loss_parallel else 1)
        if job.chunked_loss or job.compiled_loss:  # the compiled loss: as probe_of says
            kept_logits = BF16 * logits
            loss_working = 2 * BF16 * logits + FP32 * min(chunked_loss.CHUNK_ELEMENTS, logits)
        else:
            kept_logits, loss_working = FP32 * logits, 3 * FP32 * logits
        saved += share.head_inflight * BF16 * s * b * m.dim * (1 + (1 / t if sp else 1))
        saved += (share.head_inflight - 1) * kept_logits   # other micro-batches' (GPipe)
        working = max(working, loss_working)
    return saved + working
