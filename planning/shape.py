"""What the planner plans for: a model's sizes, the cluster and the batch (a `Job`), and
which of parallel's pipeline schedules it models. A layout of a job is the trainer's own
type, `ParallelDims` (parallel/layout.py): the search's candidates are the layouts
train.py runs, and a config's layout is estimated as train.py resolved it.

Conventions of the models above this file (memory.py, step_time.py): bytes; "local" = one
GPU's slice before FSDP shards it (after TP); s = sequence length, b = sequences per
micro-batch, h = model width, t = TP degree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshtrain.models import registry
from meshtrain.parallel.layout import ParallelDims
from meshtrain.parallel.vocabulary import STRATEGIES
from meshtrain.physics.flops import flops_per_token
from meshtrain.physics.gpus import GPU
from meshtrain.planning.hardware import Topology, check_collective_sms, default_topology

# The pipeline schedules the planner searches and estimates, of all parallel's
# (parallel/vocabulary.py): 1F1B and its interleaved form, and GPipe. GPipe has 1F1B's
# bubble and holds every micro-batch in flight, so the search offers it only where 1F1B is
# refused (fewer micro-batches than stages, which GPipe runs); LoopedBFS never wins; the
# zero-bubble ones split a backward in two, which the step-time model does not.
PLANNED_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a model flavor, counted on a one-layer meta copy of the family's model
    (models/registry.py). The closed-form activation terms of memory.py are written for a
    Llama-shaped block (attention + gated FFN); for other families they are an approximation."""
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
    dims: tuple = ()         # ((key, value), ...) of [model]'s dimensions over the flavor's (dim, n_heads, ...)
    # A mixture of experts (models with expert_modules(), models/registry.py): its first
    # `dense_layers` blocks are sized as above, the others are MoE blocks of `moe_split` +
    # `moe_replicated` non-expert parameters (attention, router, shared experts, norms) and
    # `expert_params` routed-expert weights (all n_experts, each moe_hidden wide), of which a
    # token uses top_k. Expert weights are replicated over TP and split over ep.
    dense_layers: int = 0
    moe_split: int = 0
    moe_replicated: int = 0
    expert_params: int = 0
    n_experts: int = 0
    top_k: int = 0
    moe_hidden: int = 0      # one routed expert's SwiGLU width
    shared_hidden: int = 0   # the shared experts' SwiGLU width (0: none)
    # ((column-split, row-split) Linears of a dense block, of a MoE block) for a TP plan whose
    # Linears each reduce (or, with sequence parallelism, gather and scatter) their own
    # activations (Hugging Face models', KempnerForge's); () for the native plans.
    tp_reductions: tuple = ()
    ep_divisible: dict | None = field(default=None, compare=False)  # what ep must divide; None: no experts

    @classmethod
    def from_flavor(cls, flavor: str, vocab_size: int | None = None, family: str = "llama",
                    **dims: int) -> "ModelShape":
        """A flavor's sizes, with ``dims`` (dim, n_heads, n_kv_heads, ffn_hidden, n_layers: the
        [model] keys) over the flavor's: a custom size of a native family."""
        # One block is enough to count a block; the layer count comes from the flavor.
        overrides = {"vocab_size": vocab_size} if vocab_size else {}
        fam = registry.get(family)
        n_layers = dims.pop("n_layers", 0) or fam.flavors[flavor].n_layers
        build = {"n_layers": 1}
        dense = dims.get("n_dense_layers", getattr(fam.flavors[flavor], "n_dense_layers", 0))
        if 0 < dense < n_layers:  # a mixture with dense first blocks: one of each is enough
            build = {"n_layers": 2, "n_dense_layers": 1}
        elif dense:  # every block dense (an MoE flavor's dense twin)
            build = {"n_layers": 1, "n_dense_layers": 1}
        m = fam.model_class().from_flavor(flavor, meta=True, **overrides, **{**dims, **build})
        shape = cls.from_model(m, flavor=flavor, n_layers=n_layers, family=family,
                               learned_positions=fam.learned_positions)
        if shape.expert_params:
            shape = dataclasses.replace(shape, dense_layers=min(dense, n_layers))
        return dataclasses.replace(shape, dims=tuple(sorted(dims.items())))

    @classmethod
    def from_model(cls, m, *, flavor: str, n_layers: int, family: str, learned_positions: bool) -> "ModelShape":
        """Sizes counted on a model (on meta) with at least one block."""
        from torch import nn

        c = m.cfg
        # Routed experts (the registry's optional expert_modules()): [n_experts, ...] weights.
        experts = {id(p): p for mod in (m.expert_modules().values() if hasattr(m, "expert_modules") else ())
                   for p in mod.parameters()}
        blocks = list(m.transformer_blocks().children())
        is_moe = lambda b: any(id(p) in experts for p in b.parameters())
        moe_block = next((b for b in blocks if is_moe(b)), None)
        block = next((b for b in blocks if not is_moe(b)), moe_block)
        in_block = {id(p) for p in m.transformer_blocks().parameters()}  # every block's: m may have more than one
        embeddings = [mod.weight for mod in m.modules() if isinstance(mod, nn.Embedding)]
        outside = [p for p in m.parameters() if id(p) not in in_block and all(p is not e for e in embeddings)]
        count = lambda params, ndim: sum(p.numel() for p in params if p.ndim == ndim and id(p) not in experts)
        n_kv = getattr(c, "n_kv_heads", None) or c.n_heads
        moe = {}
        if moe_block is not None:
            routed = [p for p in moe_block.parameters() if id(p) in experts]
            moe = dict(moe_split=count(moe_block.parameters(), 2), moe_replicated=count(moe_block.parameters(), 1),
                       expert_params=sum(p.numel() for p in routed), n_experts=routed[0].shape[0],
                       top_k=c.top_k, moe_hidden=c.moe_hidden,
                       shared_hidden=getattr(c, "n_shared_experts", 0) * c.moe_hidden,
                       ep_divisible=m.ep_divisible())
        # A plan whose Linears reduce their own activations (Hugging Face models'): its
        # (column-split, row-split) counts of a dense and a MoE block (planning/step_time.py).
        per_block = m.tp_reductions() if hasattr(m, "tp_reductions") else None
        pick = lambda b: per_block[blocks.index(b)] if b is not None else (0, 0)
        reductions = (pick(block), pick(moe_block)) if per_block else ()
        return cls(flavor=flavor, n_layers=n_layers, dim=c.dim, n_heads=c.n_heads,
                   kv_dim=n_kv * c.head_dim, ffn_hidden=c.ffn_hidden, vocab=c.vocab_size,
                   layer_split=count(block.parameters(), 2), layer_replicated=count(block.parameters(), 1),
                   embedding=sum(e.numel() for e in embeddings),
                   head_split=count(outside, 2) or (embeddings[0].numel() if c.tie_embeddings else 0),
                   head_replicated=count(outside, 1), tied=c.tie_embeddings,
                   tp_divisible=m.tp_divisible(), family=family,
                   max_positions=c.max_seq_len if learned_positions else 0,
                   head_dim=getattr(c, "head_dim", 0) or 0,
                   dense_layers=(c.n_dense_layers if moe else 0), tp_reductions=reductions, **moe)

    @property
    def layer_params(self) -> int:
        return self.layer_split + self.layer_replicated

    @property
    def moe_layers(self) -> int:
        """Blocks with routed experts: the last n_layers - dense_layers (0 for a dense model)."""
        return self.n_layers - self.dense_layers if self.expert_params else 0

    @property
    def moe_layer_params(self) -> int:
        return self.moe_split + self.moe_replicated + self.expert_params

    @property
    def n_params(self) -> int:
        head = 0 if self.tied else self.head_split  # a tied output is the embedding's weight
        return ((self.n_layers - self.moe_layers) * self.layer_params + self.moe_layers * self.moe_layer_params
                + self.embedding + head + self.head_replicated)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (MFU and
        the FLOPs count them, as training/metrics.py does with the model's active_parameters())."""
        unused = self.expert_params * (self.n_experts - self.top_k) // self.n_experts if self.n_experts else 0
        return self.n_params - self.moe_layers * unused

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token by the one definition (physics/flops.py), as train.py
        counts them: a tied output layer is a matmul too; a mixture of experts counts the
        parameters a token uses (its active ones)."""
        return flops_per_token(params=self.active_params, embedding=self.embedding,
                               tied_output=self.head_split if self.tied else 0, n_layers=self.n_layers,
                               dim=self.dim, seq_len=seq_len)


# Bytes per element of the gradient reductions the planner knows ([training] mixed_precision_reduce).
REDUCE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Job:
    model: ModelShape
    gpu: GPU
    nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch: int
    compiled: bool = False   # [compile] enable: element-wise chains fused (planning/kernels.py)
    # The fraction of the parameters that train: below 1 with [lora], whose frozen base has
    # no gradient and no optimizer state (its fp32 shards are kept: they are the weights).
    trainable: float = 1.0
    lora: tuple = ()  # (rank, alpha, target_modules) of [lora], for the activation probe
    chunked_loss: bool = False  # [training] chunked_loss: no fp32 copy of the logits (training/chunked_loss.py)
    # [compile] loss: the fp32 upcast fused into the compiled loss, which saves only the bf16
    # logits (and a statistic per row) for backward: its memory is chunked_loss's (planning/memory.py).
    compiled_loss: bool = False
    # The bytes per logit the loss moves, forward and backward, for a loss none of meshtrain's
    # three is (another framework's fused kernel, its metrics over the logits); None: the
    # default's, chunked_loss's or compiled_loss's (planning/kernels.py LOSS_BYTES*).
    loss_bytes: float | None = None
    sequence_parallel: bool = True  # [parallelism] sequence_parallel (Hugging Face models never apply it)
    # TP's gathers and scatters pipelined with their matmuls, with sequence parallelism
    # (planning/step_time.py overlapped_tp_seconds): the share of what could hide that does.
    # 0: none; [compile] async_tp: ASYNC_TP_HIDES, torch's as measured; 1.0: all of it.
    tp_overlap: float = 0.0
    # [parallelism] loss_parallel: under TP the loss runs on vocab-sharded logits; False: the
    # output layer gathers them whole on every tp rank, and the loss runs over all of them.
    loss_parallel: bool = True
    topology: Topology | None = None  # the links; None: a DGX / HGX-class node of `gpu` (planning/hardware.py)
    # [optimizer] name = "Muon": the fraction of the trained parameters Muon updates (the
    # hidden matrices), which keep one fp32 moment instead of AdamW's two.
    muon: float = 0.0
    # ... and its hidden matrices, ((rows, cols, count), ...) over the whole model, and its
    # Newton-Schulz iterations: the step's compute, all-to-alls and memory (planning/muon.py).
    muon_shapes: tuple = ()
    ns_steps: int = 5
    clip: bool = True  # [training] max_norm > 0: the gradients are scaled each step (planning/param_passes.py)
    float8: str = ""  # [float8] recipe when enabled: the blocks' matmuls run faster (planning/kernels.py)
    # [float8] enable_fsdp_float8_all_gather: FSDP gathers the blocks' float8 Linear weights
    # in float8, one byte each (planning/step_time.py float8_gathered)
    float8_all_gather: bool = False
    # A mixture of experts under expert parallelism: the busiest ep rank receives this
    # many times the mean token copies per MoE layer (routing imbalance; docs/planning.md,
    # Mixture of experts: 1.25, Switch Transformer's training capacity factor). It scales
    # that rank's expert compute, its all-to-all time and its expert activations; the
    # bytes reported are the mean over the ranks (what a traced step counts).
    moe_imbalance: float = 1.25
    # The attention kernel's speed as a fraction of the bf16 peak; 0: torch's SDPA as
    # physics/kernels/ measured it on this GPU by sequence length, else the GPU's
    # `attention_efficiency` (planning/matmul.py attention_rate). For a run whose kernel is
    # another (the validation's other frameworks).
    attention_efficiency: float = 0.0
    # Whether a unit's backward all-gather is issued ahead, beside the compute of the unit
    # before it: FSDP2 always does (meshtrain, torchtitan), as FSDP1's BACKWARD_PRE. False:
    # FSDP1's BACKWARD_POST (Composer's default), which issues it only once the unit before
    # has its gradients, so each backward gather waits (planning/step_time.py). For a run of
    # another framework (the validation's llm-foundry rows).
    backward_prefetch: bool = True
    # Context parallelism as Llama 3 ran it (Meta's stack): K and V all-gathered over cp,
    # each rank's queries attending to the whole sequence, their gradients reduce-scattered;
    # False: meshtrain's (parallel/context_parallel.py), all-to-alls of q, k, v and the
    # output. Its time only (planning/step_time.py); the memory planned is meshtrain's.
    # For a run of another framework (the validation's Llama 3 rows).
    cp_kv_all_gather: bool = False
    # [training] mixed_precision_reduce: the dtype FSDP reduces gradients in, and holds them
    # in while they wait to be reduced (its reduce-scatter buffers, a pipeline's or
    # gradient_sync = "step"'s unsharded sums); "bfloat16" halves those bytes and adds a cast
    # of each reduced shard back to the fp32 parameters' dtype (planning/param_passes.py).
    reduce_dtype: str = "float32"

    def __post_init__(self):
        if self.reduce_dtype not in REDUCE_BYTES:
            raise ValueError(f"reduce_dtype = {self.reduce_dtype!r}: the planner knows {', '.join(REDUCE_BYTES)}")
        if self.topology is not None:  # one described in Python; the CLI's was checked naming its file
            check_collective_sms(self.topology, self.gpu)

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element in FSDP's reductions (Job.reduce_dtype)."""
        return REDUCE_BYTES[self.reduce_dtype]

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def net(self) -> Topology:
        return self.topology or default_topology(self.gpu, self.gpus_per_node)


def shard_degree(lay: ParallelDims) -> int:
    """Ranks the model states are sharded over: FSDP's dp_shard x cp, or 1 under NO_SHARD
    (plain data parallelism: parallel/fsdp.py runs it as HSDP with shard groups of one)."""
    return 1 if STRATEGIES[lay.strategy] == 0 else lay.fsdp_shard


def replica_group(lay: ParallelDims) -> tuple[int, int]:
    """(size, stride) of the groups gradients are all-reduced over: dp_replicate (stride
    tp x dp_shard x cp) under HSDP; under NO_SHARD every data-parallel and cp rank (stride tp)."""
    if STRATEGIES[lay.strategy] == 0:
        return lay.dp * lay.cp, lay.tp
    return lay.dp_replicate, lay.tp * lay.fsdp_shard


def keeps_gathered(lay: ParallelDims) -> bool:
    """Parameters stay gathered (bf16) from a unit's forward to its backward: ZeRO-2, and
    NO_SHARD (not resharded after forward either; its "gathered" copy is the bf16 cast)."""
    return STRATEGIES[lay.strategy] in (0, 2)


def rank_batch(job: Job, lay: ParallelDims) -> int:
    """Sequences per data-parallel rank per step."""
    return job.global_batch // lay.dp


def forwards_per_step(job: Job, lay: ParallelDims) -> int:
    """Forwards each GPU runs per step: accumulation steps, or the pipeline's m."""
    return lay.pp_microbatches if lay.pp > 1 else lay.grad_accum(job.global_batch)
