"""Closed-form estimates for one parallel layout of a model (Llama-shaped blocks): memory per GPU, bytes sent per
step on each mesh dimension, and step time. docs/planning.md derives every term.

These are estimates to *rank* layouts against each other, not predictions: the formulas
count what autograd, FSDP2 and the pipeline schedules of this code base keep alive, but
ignore allocator fragmentation, CUDA/NCCL workspaces and kernel efficiency below that of
one large matmul. A tracked dry run (`train.py --dry-run`) measures the memory.

Conventions: bytes; "local" = one GPU's slice before FSDP shards it (after TP); s =
sequence length, b = sequences per micro-batch, h = model width, t = TP degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshtrain.planning.hardware import GPU
from meshtrain.planning.kernels import block_seconds, head_seconds
from meshtrain.planning.schedule import SUPPORTED, in_flight_at_peak, makespan, rank_actions
from meshtrain.parallel.pipeline import SCHEDULES, check_pipeline, stage_ids

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


# ---------------------------------------------------------------- the model and the layout

@dataclass(frozen=True)
class ModelShape:
    """Sizes of a model flavor, counted on a one-layer meta copy of the family's model
    (models/registry.py). The activation terms below are written for a Llama-shaped block
    (attention + gated FFN); for other families they are an approximation."""
    flavor: str
    n_layers: int
    dim: int
    n_heads: int
    kv_dim: int              # n_kv_heads * head_dim
    ffn_hidden: int
    vocab: int
    layer_split: int         # per block: 2-D weights, split by TP
    layer_replicated: int    # per block: norm weights and biases, replicated over TP
    embedding: int           # embedding tables (vocab rows split by TP)
    head_split: int          # output projection (the embedding's weight too when tied)
    head_replicated: int     # final norm
    tied: bool
    tp_divisible: dict = field(default_factory=dict, compare=False)
    family: str = "llama"
    max_positions: int = 0   # rows of a learned position table (0: positions are computed)
    head_dim: int = 0        # 0: dim / n_heads

    @classmethod
    def from_flavor(cls, flavor: str, vocab_size: int | None = None, family: str = "llama") -> "ModelShape":
        from meshtrain.models import registry

        # One block is enough to count a block; the layer count comes from the flavor.
        overrides = {"vocab_size": vocab_size} if vocab_size else {}
        fam = registry.get(family)
        m = fam.model_class().from_flavor(flavor, meta=True, n_layers=1, **overrides)
        return cls.from_model(m, flavor=flavor, n_layers=fam.flavors[flavor].n_layers, family=family,
                              learned_positions=fam.learned_positions)

    @classmethod
    def from_model(cls, m, *, flavor: str, n_layers: int, family: str, learned_positions: bool) -> "ModelShape":
        """Sizes counted on a model (on meta) with at least one block."""
        from torch import nn

        c = m.cfg
        block = next(iter(m.transformer_blocks().children()))
        in_block = {id(p) for p in m.transformer_blocks().parameters()}  # every block's: m may have more than one
        embeddings = [mod.weight for mod in m.modules() if isinstance(mod, nn.Embedding)]
        outside = [p for p in m.parameters() if id(p) not in in_block and all(p is not e for e in embeddings)]
        count = lambda params, ndim: sum(p.numel() for p in params if p.ndim == ndim)
        n_kv = getattr(c, "n_kv_heads", None) or c.n_heads
        return cls(flavor=flavor, n_layers=n_layers, dim=c.dim, n_heads=c.n_heads,
                   kv_dim=n_kv * c.head_dim, ffn_hidden=c.ffn_hidden, vocab=c.vocab_size,
                   layer_split=count(block.parameters(), 2), layer_replicated=count(block.parameters(), 1),
                   embedding=sum(e.numel() for e in embeddings),
                   head_split=count(outside, 2) or (embeddings[0].numel() if c.tie_embeddings else 0),
                   head_replicated=count(outside, 1), tied=c.tie_embeddings,
                   tp_divisible=m.tp_divisible(), family=family,
                   max_positions=c.max_seq_len if learned_positions else 0,
                   head_dim=getattr(c, "head_dim", 0) or 0)

    @property
    def layer_params(self) -> int:
        return self.layer_split + self.layer_replicated

    @property
    def n_params(self) -> int:
        head = 0 if self.tied else self.head_split  # a tied output is the embedding's weight
        return self.n_layers * self.layer_params + self.embedding + head + self.head_replicated


@dataclass(frozen=True)
class Job:
    model: ModelShape
    gpu: GPU
    nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch: int
    compiled: bool = False   # [compile] enable: element-wise chains fused (planning/kernels.py)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp_replicate: int
    dp_shard: int
    strategy: str               # FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2
    ac: str                     # none, selective (every 2nd block), full
    micro_batch: int            # sequences per forward (per pipeline micro-batch under pp)
    pp_schedule: str = "1F1B"   # only meaningful with pp > 1
    pp_microbatches: int = 1    # m: micro-batches per step through the pipeline
    stages_per_rank: int = 1    # v
    cp: int = 1                 # context parallel: each rank holds seq / cp tokens of a sequence

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards over: dp_shard x cp (cp ranks hold the same weights)."""
        return self.dp_shard * self.cp

    def local_batch(self, job: Job) -> int:
        """Sequences per data-parallel rank per step."""
        return job.global_batch // self.dp

    def micro_batches(self, job: Job) -> int:
        """Forwards each GPU runs per step: accumulation steps, or the pipeline's m."""
        return self.pp_microbatches if self.pp > 1 else self.local_batch(job) // self.micro_batch


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank (all of its dp x tp GPUs alike) holds and runs."""
    stage_layers: tuple[int, ...]   # layers in each of its stages
    first: bool                     # holds the embedding
    last: bool                      # holds the final norm and output
    inflight: float                 # (layer, micro-batch) activation sets alive at its peak
    head_inflight: int              # micro-batches whose loss is kept for backward (last stage)
    stage_ids: tuple[int, ...] = (0,)   # its stages' global indices, in stage_layers' order
    n_stages: int = 1                   # stages of the whole pipeline

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)


def rank_shares(job: Job, lay: Layout) -> list[RankShare]:
    """Per pipeline rank: its layers and how many micro-batches of activations it holds at
    its peak. Stages come from parallel.pipeline (the same split and placement train.py
    uses), so an invalid pipeline raises the same LayoutError."""
    L, pp, m, v = job.model.n_layers, lay.pp, lay.pp_microbatches, lay.stages_per_rank
    if pp == 1:
        return [RankShare((L,), True, True, inflight=L, head_inflight=1)]
    stages = check_pipeline(pp=pp, n_layers=L, schedule=lay.pp_schedule, stages_per_rank=v,
                            n_microbatches=m, local_batch=lay.local_batch(job))
    style = SCHEDULES[lay.pp_schedule][1]
    shares = []
    for r in range(pp):
        ids = stage_ids(r, pp, len(stages), style)
        sizes = tuple(len(stages[s]) for s in ids)
        if lay.pp_schedule not in SUPPORTED or style != "loop":
            raise ValueError(f"no activation-memory model for pp_schedule {lay.pp_schedule!r}")
        # Counted from torch's own order of this rank's forwards and backwards (the one the
        # dry run replays, planning/schedule.py), not a closed form: layers x micro-batches
        # alive at the rank's worst backward, and the last stage's micro-batches then.
        actions = rank_actions(lay.pp_schedule, pp, v, m)[r]
        inflight, live, _ = in_flight_at_peak(actions, {s: len(stages[s]) for s in ids})
        head = max(1, live.get(len(stages) - 1, 0))
        shares.append(RankShare(sizes, 0 in ids, len(stages) - 1 in ids, inflight, head, tuple(ids), len(stages)))
    return shares


def checkpointed_blocks(share: RankShare, ac: str) -> int:
    """Blocks apply_ac wraps on this rank: all (full), every 2nd of each stage counting
    from its first (selective, selective_every = 2), none."""
    if ac == "full":
        return share.layers
    if ac == "selective":
        return sum(math.ceil(n / 2) for n in share.stage_layers)
    return 0


# ---------------------------------------------------------------- memory

def layer_activation_bytes(m: ModelShape, s: int, b: int, t: int) -> float:
    """Bytes autograd saves for one of *our* blocks' backward (bf16 compute; RMSNorm, GQA
    through SDPA/flash, SwiGLU; sequence parallel when t > 1, as in models/llama/tp_plan.py):
      full length (SP all-gathers the normed input; the q/k/v and w1/w3 matmuls save the
      gathered tensor, once per sub-block):                           2 x 2sbh
      sequence-sharded: attention_norm and ffn_norm inputs            2 x 2sbh/t
      q after rotary, attention output (= wo input)                   2 x 2sbh/t
      k, v at kv width (GQA)                                          2 x 2sb·kv/t
      SwiGLU: w1 out, silu out, w3 out, their product (= w2 input)    4 x 2sb·f/t
      SDPA's fp32 log-sum-exp per head                                4sb·a/t
    Flash attention keeps no s x s matrix; rotary saves only its cos/sin tables."""
    h, f, kv, a = m.dim, m.ffn_hidden, m.kv_dim, m.n_heads
    return s * b * (BF16 * 2 * h + (BF16 * (4 * h + 2 * kv + 4 * f) + FP32 * a) / t)


def block_input_bytes(m: ModelShape, s: int, b: int, t: int) -> float:
    """What a checkpointed block keeps: its input, sequence-sharded (2sbh/t)."""
    return BF16 * s * b * m.dim / t


def rank_local_params(m: ModelShape, share: RankShare, tp: int) -> float:
    """Parameters one GPU of this pipeline rank holds after TP, before FSDP shards them."""
    n = share.layers * (m.layer_split / tp + m.layer_replicated)
    if share.first:
        n += m.embedding / tp
    if share.last:  # tied: the last stage holds its own copy, unless it is also the first
        n += (0 if m.tied and share.first else m.head_split / tp) + m.head_replicated
    return n


def largest_unit(m: ModelShape, share: RankShare, tp: int) -> float:
    """The biggest FSDP unit on this rank (a block, the embedding, or norm + output)."""
    units = [m.layer_split / tp + m.layer_replicated]
    if share.first:
        units.append(m.embedding / tp)
    if share.last:
        units.append(m.head_split / tp + m.head_replicated)
    return max(units)


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


def transient_bytes(m: ModelShape, share: RankShare, lay: Layout) -> float:
    """FSDP2's unsharded state at the peak.
    No pipeline, FULL_SHARD / HYBRID_SHARD: two units gathered in bf16 (the one running and
      the one prefetched) and, in backward, one unit's bf16 gradient with its fp32 copy for
      the reduce-scatter: (2 + 2 + 2 + 4) x largest unit.
    No pipeline, SHARD_GRAD_OP / HYBRID_SHARD_ZERO2: every unit stays gathered from its
      forward to its backward, so the whole local model in bf16, plus the gradient buffers.
    Pipeline, any strategy: torch's PipelineStage turns off resharding after backward and
      gradient sync until the step's last backward, so the whole stage stays gathered (bf16)
      and its gradients accumulate unsharded in the fp32 reduce dtype until the one
      reduce-scatter per step: 2 + 4 bytes per local param, plus one unit's bf16 gradient."""
    local, unit = rank_local_params(m, share, lay.tp), largest_unit(m, share, lay.tp)
    if lay.pp > 1:
        return (BF16 + FP32) * local + BF16 * unit
    if lay.strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"):
        return BF16 * local + (BF16 + FP32) * unit
    return (2 * BF16 + BF16 + FP32) * unit


def memory_per_gpu(job: Job, lay: Layout) -> Memory:
    """Peak bytes per GPU on the worst pipeline rank (the one with the largest total).
    Activations come from a traced probe of two blocks (planning/activations.py) where the
    family can build one; otherwise from the formulas above."""
    from meshtrain.planning.activations import profile_for

    prof = profile_for(job.model, job.seq_len // lay.cp, lay.tp, lay.ac)
    worst = None
    for r, share in enumerate(rank_shares(job, lay)):
        if prof is not None:
            mem = traced_memory(job, lay, r, share, prof)
        else:
            mem = Memory(pp_rank=r, **fsdp2_model_states(rank_local_params(job.model, share, lay.tp), lay.fsdp_shard))
            mem.activations, mem.transient = formula_activations(job, lay, share), transient_bytes(job.model, share, lay)
        if worst is None or mem.total > worst.total:
            worst = mem
    return worst


def _units(m: ModelShape, tp: int) -> tuple[float, float, float]:
    """Local parameters of one block, the embedding and the head (final norm + output)."""
    return (m.layer_split / tp + m.layer_replicated, m.embedding / tp,
            (m.head_split if not m.tied else m.embedding) / tp + m.head_replicated)


def traced_memory(job: Job, lay: Layout, rank: int, share: RankShare, prof) -> Memory:
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
    block, embed, head = _units(m, t)
    local = rank_local_params(m, share, t)
    shard = lay.fsdp_shard
    mem = Memory(pp_rank=rank, params=FP32 * local / shard, optimizer=2 * FP32 * local / shard)
    zero2 = lay.strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")
    accumulating = lay.local_batch(job) > b * (lay.pp_microbatches if lay.pp > 1 else 1)
    held_grads = FP32 * local / shard if accumulating else 0.0
    gathered = lambda *units: BF16 * (local if zero2 else sum(units))
    if lay.pp == 1:
        kept = b * (prof.embed + prof.kept(share.layers))
        moments = [  # (gradients, transient, activations)
            (held_grads, gathered(head), kept + b * (prof.head + prof.head_working)),
            (held_grads, gathered(block, block) + (BF16 + FP32) * block, kept + b * prof.block_working),
            (held_grads, gathered(head), kept + b * (prof.head + prof.forward_extra)),
            (FP32 * local / shard, gathered(embed) + (BF16 + FP32) * embed, b * (prof.embed + prof.kept(1))),
        ]
        mem.grads, mem.transient, mem.activations = max(moments, key=sum)
        return mem
    weight, working, after, running = {}, {}, {}, {}
    for s, n in zip(share.stage_ids, share.stage_layers):
        first, last = s == 0, s == share.n_stages - 1
        weight[s] = b * ((prof.embed if first else prof.stage_input) + prof.kept(n)
                         + (prof.head if last else 0))
        working[s] = b * max(prof.block_working, prof.head_working if last else 0)
        params = n * block + first * embed + last * (0 if (m.tied and first) else head)
        after[s] = FP32 * params + (0 if zero2 else BF16 * params)
        running[s] = 0 if zero2 else BF16 * (head if last else block)
    actions = rank_actions(lay.pp_schedule, lay.pp, lay.stages_per_rank, lay.pp_microbatches)[rank]
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
    return mem


def formula_activations(job: Job, lay: Layout, share: RankShare) -> float:
    """The closed forms (a Llama-shaped block): for families the probe cannot build."""
    # Under context parallelism every activation holds this rank's seq / cp tokens (the
    # all-to-alls trade tokens for heads: q, k, v keep their bytes).
    m, s, b, t = job.model, job.seq_len // lay.cp, lay.micro_batch, lay.tp
    full, kept = layer_activation_bytes(m, s, b, t), block_input_bytes(m, s, b, t)
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
        logits = s * b * m.vocab / t
        saved += share.head_inflight * BF16 * s * b * m.dim * (1 + 1 / t)
        saved += (share.head_inflight - 1) * FP32 * logits   # other micro-batches' (GPipe)
        working = max(working, 3 * FP32 * logits)
    return saved + working


# ---------------------------------------------------------------- communication and time

def fsdp_rounds(lay: Layout, job: Job) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of each FSDP unit per step.
    No pipeline: every micro-batch gathers in forward (and again in backward with
    FULL_SHARD) and reduce-scatters its gradients (train_step keeps gradient sync on).
    Pipeline: SHARD_GRAD_OP gathers once per step; FULL_SHARD re-gathers after every
    forward, m + 1 times (the 3 + 2n measured in docs/pipeline.md for 2 resharding units
    and 1 that is not); one reduce-scatter per step either way."""
    zero2 = lay.strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")
    n = lay.micro_batches(job)
    if lay.pp > 1:
        return (1 if zero2 else n + 1), 1
    return (n if zero2 else 2 * n), n


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """A mesh group of ``size`` ranks, ``stride`` apart (tp innermost, see parallel/mesh.py),
    leaves the node when it covers more ranks than a node has."""
    return size > 1 and stride * size > gpus_per_node


@dataclass
class Estimate:
    layout: Layout
    memory: Memory
    step_time: float
    tokens_per_s_per_gpu: float
    mfu: float
    comm_bytes: dict[str, float]   # per GPU per step, sent, by mesh dimension
    times: dict[str, float]        # seconds per step: compute, tp, pp, bubble, fsdp, optimizer
    fsdp_comm_time: float          # all of FSDP's collectives, hidden or not
    compute_split: dict[str, float] = field(default_factory=dict)  # compute: matmul, attention, memory-bound


def estimate(job: Job, lay: Layout) -> Estimate:
    from meshtrain.training.metrics import flops_per_token  # the FLOPs train.py reports MFU with

    m, gpu, s, b, t, cp = job.model, job.gpu, job.seq_len, lay.micro_batch, lay.tp, lay.cp
    g, n_mb = job.gpus_per_node, lay.micro_batches(job)
    shares = rank_shares(job, lay)
    act = BF16 * s // cp * b * m.dim         # one micro-batch's hidden states, this rank's tokens
    # The mesh is pp x dp_replicate x dp_shard x cp x tp: cp groups stride tp, FSDP's
    # (dp_shard x cp) too, replicas tp x dp_shard x cp.
    bw_dp = gpu.inter_node_bw if spans_nodes(t, lay.fsdp_shard, g) else gpu.intra_node_bw
    bw_rep = gpu.inter_node_bw if spans_nodes(t * lay.fsdp_shard, lay.dp_replicate, g) else gpu.intra_node_bw
    bw_pp = gpu.inter_node_bw if spans_nodes(t * lay.dp * cp, lay.pp, g) else gpu.intra_node_bw
    bw_cp = gpu.inter_node_bw if spans_nodes(t, cp, g) else gpu.intra_node_bw

    per_mb, tp_bytes, pp_bytes, cp_bytes, fsdp, parts = [], [], [], [], [], []
    for share in shares:
        ckpt = checkpointed_blocks(share, lay.ac)
        # Matmuls, attention and memory-bound work at their own speeds (planning/kernels.py);
        # this rank runs s / cp tokens of each of the micro-batch's b sequences.
        tokens = b * s / cp
        run = lambda recompute: block_seconds(m, tokens=tokens, seq=s, tp=t, cp=cp, gpu=gpu,
                                              recompute=recompute, compiled=job.compiled)
        seconds = (run("full") * ckpt + run("op" if lay.ac == "op" else "none") * (share.layers - ckpt))
        if share.last:
            seconds = seconds + head_seconds(m, tokens=tokens, tp=t, gpu=gpu)
        compute = seconds.total
        parts.append(seconds)
        # TP with SP, per block: 2 all-gathers + 2 reduce-scatters of the activation forward,
        # the same in backward, and again forward for recomputed blocks; embedding and output
        # add one each way. Each moves (t-1)/t of the activation per GPU.
        n_coll = 8 * share.layers + 4 * ckpt + 2 * share.first + 2 * share.last
        tp_b = n_coll * act * (t - 1) / t
        # PP: each stage boundary sends the sequence-sharded activation forward and its
        # gradient back.
        sends = 2 * len(share.stage_layers) - share.first - share.last if lay.pp > 1 else 0
        pp_b = sends * act / t
        # CP: per block the four all-to-alls (q, k, v, out) run in forward, in backward, and
        # again for a recomputed block; each sends (cp-1)/cp of this rank's piece. They sit
        # between the projections and attention: on the critical path.
        cp_b = (2 * share.layers + ckpt) * cp_exchange_bytes(m, s, b, t, cp) * (cp - 1) / cp
        per_mb.append((compute, tp_b / gpu.intra_node_bw, pp_b / bw_pp, cp_b / bw_cp))
        tp_bytes.append(tp_b * n_mb)
        pp_bytes.append(pp_b * n_mb)
        cp_bytes.append(cp_b * n_mb)
        local = rank_local_params(m, share, t)
        fsdp.append((local, largest_unit(m, share, t)))

    # The slowest pipeline rank sets the pace of every micro-batch.
    worst = max(range(len(shares)), key=lambda r: sum(per_mb[r]))
    compute, tp_time, pp_time, cp_time = (x * n_mb for x in per_mb[worst])
    busy = compute + tp_time + pp_time + cp_time
    # Bubble: fill and drain take (pp - 1) micro-batch slots, v times shorter when interleaved.
    # Bubble: play torch's own schedule out with this rank's times (planning/schedule.py),
    # a backward twice a forward; for 1F1B that is fill and drain, (pp - 1) micro-batches.
    bubble = 0.0
    if lay.pp > 1 and lay.pp_schedule in SUPPORTED:
        chunk = busy / n_mb / lay.stages_per_rank  # one micro-batch through one stage
        bubble = makespan(lay.pp_schedule, lay.pp, lay.stages_per_rank, n_mb, chunk / 3, 2 * chunk / 3) - busy
    elif lay.pp > 1:
        bubble = busy * (lay.pp - 1) / lay.stages_per_rank / n_mb

    # FSDP on the rank with the most parameters. Ring collectives: each GPU sends (n-1)/n of
    # the unsharded bytes; gathers in bf16, reductions in fp32; HSDP all-reduces the shard.
    local, unit = max(fsdp)
    ds, dr = lay.fsdp_shard, lay.dp_replicate
    n_ag, n_rs = fsdp_rounds(lay, job)
    ag = BF16 * local * (ds - 1) / ds
    rs = FP32 * local * (ds - 1) / ds
    ar = 2 * FP32 * local / ds * (dr - 1) / dr
    fsdp_time = (n_ag * ag + n_rs * rs) / bw_dp + n_rs * ar / bw_rep
    # Overlap: FSDP2 prefetches, so its collectives hide behind compute except the first
    # unit's gather and the last unit's reduction of each round. Under a pipeline the one
    # reduce-scatter (+ HSDP all-reduce) runs after the last backward: fully exposed.
    frac = unit / local
    if lay.pp > 1:
        gathers = n_ag * ag / bw_dp
        exposed = max(0.0, gathers - compute) + frac * ag / bw_dp + rs / bw_dp + ar / bw_rep
    else:
        exposed = max(0.0, fsdp_time - compute) + n_mb * frac * (ag / bw_dp + rs / bw_dp + ar / bw_rep)
    # AdamW is memory-bound: read param, grad, m, v; write param, m, v (fp32), + the grad norm.
    optimizer = 8 * FP32 * local / ds / gpu.hbm_bandwidth

    step = busy + bubble + exposed + optimizer
    tokens = job.global_batch * s
    tps = tokens / step / job.world
    model_flops = flops_per_token(m.n_params, m.embedding, m.n_layers, m.dim, s)
    return Estimate(
        layout=lay, memory=memory_per_gpu(job, lay), step_time=step, tokens_per_s_per_gpu=tps,
        mfu=tps * model_flops / gpu.peak_bf16_flops,
        comm_bytes={"dp_shard": n_ag * ag + n_rs * rs, "dp_replicate": n_rs * ar,
                    "tp": max(tp_bytes), "pp": max(pp_bytes), **({"cp": max(cp_bytes)} if cp > 1 else {})},
        times={"compute": compute, "tp": tp_time, "pp": pp_time, **({"cp": cp_time} if cp > 1 else {}),
               "bubble": bubble, "fsdp": exposed, "optimizer": optimizer}, fsdp_comm_time=fsdp_time,
        compute_split={k: getattr(parts[worst], k) * n_mb for k in ("matmul", "attention", "memory")})


def cp_exchange_bytes(m: ModelShape, s: int, b: int, t: int, cp: int) -> float:
    """Bytes one block's four all-to-alls take in, on one rank: q and the attention output
    at query width, k and v at kv width (repeated when a TP rank's kv heads do not split
    over cp; parallel.context_parallel.kv_repeats), for seq / cp tokens, bf16."""
    if cp == 1:
        return 0.0
    from meshtrain.parallel.context_parallel import kv_repeats

    head_dim = m.head_dim or m.dim // m.n_heads
    repeats = kv_repeats(m.n_heads // t, m.kv_dim // head_dim // t, cp)
    return BF16 * s // cp * b * (2 * m.n_heads * head_dim + 2 * m.kv_dim * repeats) / t
