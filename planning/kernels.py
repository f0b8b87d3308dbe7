"""Compute time of one micro-batch on one GPU, op class by op class, from kernel speeds.

    t = block_seconds(model, tokens=8192, seq=8192, tp=1, cp=1, gpu=H100, recompute="none")
    t.matmul, t.attention, t.memory      # seconds

A step is not "the model FLOPs at one efficiency". Three classes of work run at three
speeds, each kept per GPU in physics/gpus.py with where it comes from:

- **matmuls** (the projections, the FFN, the output layer): each Linear as the three
  matmuls it runs (forward, input gradient, weight gradient), each timed at its own shape
  by planning/matmul.py: measured rates where bench/results has them for the GPU, else a
  roofline whose large-matmul asymptote is `matmul_efficiency` of the bf16 peak (measured
  by bench/gpu_check.py on an 8192^3 matmul), slowed by tile and wave quantization.
- **attention** (torch's SDPA): forward 4 s^2 d FLOPs per head over the full s x s,
  halved by the causal mask (the kernel skips masked tiles); backward 2.5 x the forward
  (five matmuls against two, the convention of the FlashAttention papers' benchmarks). At
  the rate `bench.kernel_speeds` measured by sequence length where physics/kernels/ has
  this GPU (`attention_rate`: on the H100, torch 2.11, 22% of the peak at 1,024 tokens to
  55% at 16,384), else at `attention_efficiency` of the peak (FlashAttention-2's published
  35% on an H100: Shah et al. 2024, FlashAttention-3, abstract). `Job.attention_efficiency`
  names another kernel's speed (the validation's runs of other frameworks).
- **memory-bound element-wise work** (norms, rotary, SwiGLU / GeLU, residual adds, layout
  copies, the fp32 cross-entropy over the vocabulary): bytes moved at the GPU's measured
  copy bandwidth. Counted per token from the block's ops (`_bytes_per_token`): eager runs
  each op as its own kernel; torch.compile fuses each chain into one read and one write.

Recomputation (AC) runs a block's forward again: all three for `full`, only the
element-wise work for `op` (its policy saves matmul and attention outputs).
Not modelled: Python overhead (hidden while the GPU has work queued), the routed experts'
matmuls by shape (grouped GEMMs at the large-matmul speed), power or clock limits below the spec.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from meshtrain.planning import matmul
from meshtrain.planning.matmul import linear_seconds, load_matmul_table

BF16 = 2
FP32 = 4
FA_BACKWARD = 2.5      # backward / forward FLOPs of flash attention (FlashAttention-2 paper's benchmark convention)
# Bytes per element of an eager RMSNorm: the composite's fp32 passes (r2 w4, r4 w4, r4, r4 w4,
# r4 w2, r2 w2). The measured gap between eager and compiled steps on an H100 (Llama 3 8B
# shape, 10 layers, one 8192-token sequence: 36.9 ms per step, bench/results/2026-11-22_h100_run5.json)
# is what this count predicts (34 ms), not what a fused norm's 4 bytes would (10 ms).
RMS_NORM_EAGER = 40
# [float8] recipe -> how much faster the Linear layers' matmuls run than in bf16 (the
# output layer, attention and element-wise work stay bf16). From the H100 measurement of
# docs/benchmarks.md (10 Llama-3-8B blocks, seq 8192, compiled, op-level AC, one GPU, one
# sequence a step: tensorwise 1.16x bf16 tokens/s, rowwise 1.00x): the factor with which
# the planner's whole step there, its matmuls timed from the measured H100 table
# (physics/kernels/h100.json), gives 1.16x; rowwise measured no gain. With 8 micro-batches
# a step the same factor gives 1.176x, against 1.181x measured (2026-11-28, not fitted).
# (1.46 while attention was timed at a flat 35% of the peak rather than by length.)
# Net of float8's casts: the profile of that step times the block matmuls themselves 1.93x
# faster (bench/results/2026-11-26_h100_ac_policy_profile.txt).
# torchao's published end-to-end gains are higher (tensorwise up to 1.25x at 8 GPUs / Llama
# 3 8B, rowwise 1.12x, torchtitan commit 7a04053): docs/planning.md, Float8.
FLOAT8_MATMUL_SPEEDUP = {"tensorwise": 1.42, "rowwise": 1.0}
# The loss's memory traffic per logit, forward and backward, each op reading its inputs
# once and writing its outputs once (tests/test_chunked_loss.py counts them on the code).
# F.cross_entropy on the fp32 upcast: the upcast (2 + 4), log-softmax (4 + 4), nll's
# backward writing a zero gradient (4), log-softmax's backward (4 + 4 + 4), the gradient
# cast back to bf16 (4 + 2). A lower bound: a row of a large vocabulary (512 KB at 128K
# words) does not fit on chip, so the softmax kernel may read it more than once.
LOSS_BYTES = 36
# [training] chunked_loss (training/chunked_loss.py) reads the logits twice and redoes the
# softmax in backward: the trade for its 4 bytes per logit at the peak instead of 12.
# Forward: the chunk's upcast (2 + 4), its max (4), subtract and exp in place (8 + 8), the
# sum (4); backward: the upcast (6), subtract and exp (16), the scale (8), the bf16
# gradient (4 + 2). Under loss_parallel its two small all-reduces per chunk are not counted.
LOSS_BYTES_CHUNKED = 66
# [compile] loss (training/step.py): inductor fuses the upcast into the softmax's reductions
# and the whole backward into one kernel. Forward: the row's max (2) and its sum of exps (2),
# each a pass over the bf16 logits; backward: the logits read (2) and their bf16 gradient
# written (2). Counted on inductor's own fused kernels (tests/test_chunked_loss.py). On an H100
# (bench/results/2026-11-28_h100_float8_accum8_kernels_loss.json, 8,192 tokens x 128,256
# words) it ran in 3.1 ms against the 2.8 these bytes give at hbm_bandwidth; the default,
# 18.0 ms against 12.6; the chunked one, 29.8 against 23.1.
LOSS_BYTES_COMPILED = 8


def load_attention_table(path: Path) -> tuple[str, tuple[tuple[int, float], ...]] | None:
    """(device name, ((sequence length, FLOP/s), ...)) of a `bench.kernel_speeds` JSON's
    attention rows (SDPA, causal, head dim 128, forward and backward); None where
    `load_matmul_table` gives None or the file has no attention rows."""
    if load_matmul_table(path) is None:
        return None
    result = json.loads(Path(path).read_text())
    rows = tuple(sorted((int(r["seq"]), float(r["tflops"]) * 1e12) for r in result.get("attention") or ()))
    return (result["device"], rows) if rows else None


@lru_cache(maxsize=None)
def measured_attention(folder: Path) -> dict[str, tuple]:
    """GPU name -> its measured attention rows (planning/matmul.py `tables_by_gpu`)."""
    return matmul.tables_by_gpu(folder, load_attention_table)


def attention_rate(seq: int, gpu) -> float:
    """FLOP/s of causal flash attention, forward and backward, over sequences of ``seq``
    (planning/kernels.py counts its FLOPs): between measured lengths linear in log(seq),
    beyond them the nearest measured length's rate; without a measured table
    `attention_efficiency` of the peak. The kernel gets faster with the sequence (the
    H100's: 22% of the peak at 1,024 tokens, 55% at 16,384): more key tiles per query tile
    to amortise each tile's start, and fewer of the diagonal tiles the mask half-wastes."""
    rows = measured_attention(matmul.TABLES).get(gpu.name)  # read here: tests point TABLES elsewhere
    if not rows:
        return gpu.peak_bf16_flops * gpu.attention_efficiency
    if seq <= rows[0][0]:
        return rows[0][1]
    for (s0, r0), (s1, r1) in zip(rows, rows[1:]):
        if seq <= s1:
            w = math.log(seq / s0) / math.log(s1 / s0)
            return r0 + w * (r1 - r0)
    return rows[-1][1]


@dataclass
class Seconds:
    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.memory

    def __add__(self, other: "Seconds") -> "Seconds":
        return Seconds(self.matmul + other.matmul, self.attention + other.attention, self.memory + other.memory)

    def __mul__(self, k: float) -> "Seconds":
        return Seconds(self.matmul * k, self.attention * k, self.memory * k)


def gated(m) -> bool:
    """A SwiGLU block (three FFN matrices) rather than a GeLU one (two), from its size."""
    h, kv, f = m.dim, m.kv_dim, m.ffn_hidden
    attn = 2 * h * h + 2 * h * kv
    return abs(m.layer_split - (attn + 3 * h * f)) < abs(m.layer_split - (attn + 2 * h * f))


def _bytes_per_token(m, tp: int, compiled: bool) -> float:
    """Element-wise bytes of one block's forward per token on one GPU (bf16; h width,
    kv the kv width, f the FFN width, each / tp where TP splits it). Eager, one kernel per
    op, each reading its inputs and writing its output: two norms (LayerNorm's fused kernel
    4h; RMSNorm, which eager torch runs as its composite -- upcast, square, mean, rsqrt,
    scale, weight, downcast -- 40h, `RMS_NORM_EAGER`), rotary on q and k (seven passes: 14 bytes per
    element), the attention output's layout copy (4h), SwiGLU's SiLU and product (10f; GeLU
    alone 4f), two residual adds (6h each). Compiled: norm and residual fused (8h each),
    rotary in one pass (4 per element), the FFN activation in one (6f; GeLU 4f), the copy.
    The backward moves about twice the forward's bytes (each op reads its saved inputs and
    the incoming gradient and writes one gradient per input). Norms and residual adds run
    on the sequence-sharded activations (sequence parallel): / tp as well. The rotary count
    is that of the pairs rotated by hand, which the measured eager runs ran; one complex
    multiply now does it (three kernels: upcast, multiply, downcast), not yet timed on a GPU,
    so the count stays until a device run measures the new one (bench/kernel_speeds.py's
    `rotary_eager_bytes_per_element`, which bench/gpu_check.py's kernels section runs)."""
    h, kv, f = m.dim, m.kv_dim, m.ffn_hidden
    rotary = not m.max_positions  # learned positions (GPT-2): no rotary, LayerNorm
    hs, kvs, fs = h / tp, kv / tp, f / tp
    if compiled:
        return 2 * 8 * hs + (4 * (hs + kvs) if rotary else 0) + 4 * hs + (6 if gated(m) else 4) * fs
    norm = RMS_NORM_EAGER if rotary else 4
    return 2 * norm * hs + (14 * (hs + kvs) if rotary else 0) + 4 * hs + (10 if gated(m) else 4) * fs + 2 * 6 * hs


def block_linears(m, tp: int) -> list[tuple[int, int]]:
    """(in, out) of each Linear of a block as one TP rank runs it: q, k, v and the FFN's
    input projections split their outputs (column-wise), the attention output and the FFN's
    output projection their inputs (row-wise)."""
    h, kv, f = m.dim, m.kv_dim, m.ffn_hidden
    q = m.n_heads * (m.head_dim or m.dim // m.n_heads)
    split = lambda width: math.ceil(width / tp)
    ffn = [(h, split(f))] * (2 if gated(m) else 1) + [(split(f), h)] if f else []
    return [(h, split(q)), (h, split(kv)), (h, split(kv)), (split(q), h)] + ffn


def block_matmul_seconds(m, tokens: int, tp: int, gpu) -> tuple[float, float]:
    """(forward, backward) of a block's matmuls on one GPU, each Linear at its own shape
    (planning/matmul.py). 2-D weights the Linears above do not account for (an MoE block's
    router) run at the large-matmul speed; so does a whole block of another shape."""
    shapes = block_linears(m, 1)
    rest = m.layer_split - sum(i * o for i, o in shapes)
    flat = 2 * tokens / tp / (gpu.peak_bf16_flops * gpu.matmul_efficiency)
    if rest < 0:
        return flat * m.layer_split, 2 * flat * m.layer_split
    runs = [linear_seconds(tokens, i, o, gpu) for i, o in block_linears(m, tp)]
    return sum(f for f, _ in runs) + flat * rest, sum(b for _, b in runs) + 2 * flat * rest


def block_seconds(m, *, tokens: float, seq: int, tp: int, cp: int, gpu, recompute: str,
                  compiled: bool = False, float8: str = "", attention_efficiency: float = 0.0) -> Seconds:
    """One block's forward and backward over ``tokens`` tokens of sequences of ``seq``
    (this GPU holds seq / cp of each, and 1 / tp of the heads and FFN width).
    ``recompute``: "none", "full" (the forward again), "op" (its element-wise work again)."""
    peak = gpu.peak_bf16_flops
    fwd, bwd = block_matmul_seconds(m, round(tokens), tp, gpu)
    head_dim = m.head_dim or m.dim // m.n_heads
    # Each of this GPU's query heads attends over the whole causal sequence; under cp the
    # all-to-all hands it every token of n_heads / (tp cp) heads: the same FLOPs per GPU.
    attn_fwd = 4 * seq * head_dim * (m.n_heads / tp) * tokens / 2
    mem = _bytes_per_token(m, tp, compiled) * tokens
    passes = {"none": (1, 1 + FA_BACKWARD, 3), "full": (2, 2 + FA_BACKWARD, 4), "op": (1, 1 + FA_BACKWARD, 4)}
    n_fwd, k_attn, k_mem = passes[recompute]
    speedup = FLOAT8_MATMUL_SPEEDUP[float8] if float8 else 1.0  # [float8]: the block's Linear layers
    return Seconds(matmul=(fwd * n_fwd + bwd) / speedup,
                   attention=attn_fwd * k_attn / (peak * attention_efficiency if attention_efficiency
                                                  else attention_rate(seq, gpu)),
                   memory=mem * k_mem / gpu.hbm_bandwidth)


def head_seconds(m, *, tokens: float, tp: int, gpu, loss_bytes: float = LOSS_BYTES,
                 loss_parallel: bool = True) -> Seconds:
    """The output layer's matmul (tokens x dim @ dim x vocab / tp, at its shape) and the
    cross-entropy over this GPU's vocabulary, moving ``loss_bytes`` a logit
    (`loss_bytes_per_logit`): its vocab shard under loss_parallel, else the whole vocabulary,
    gathered."""
    out = (m.head_split if m.head_split else m.embedding) / tp
    fwd, bwd = linear_seconds(round(tokens), m.dim, round(out / m.dim), gpu)
    vocab = m.vocab / (tp if loss_parallel else 1)
    return Seconds(matmul=fwd + bwd, memory=loss_bytes * vocab * tokens / gpu.hbm_bandwidth)


def loss_bytes_per_logit(job) -> float:
    """Bytes a job's cross-entropy moves per logit, forward and backward: ``job.loss_bytes``
    where set (another framework's loss), else [training] chunked_loss's, [compile] loss's or
    the default's (the constants above)."""
    if job.loss_bytes is not None:
        return job.loss_bytes
    return LOSS_BYTES_CHUNKED if job.chunked_loss else LOSS_BYTES_COMPILED if job.compiled_loss else LOSS_BYTES


def expert_seconds(m, *, copies: float, gpu, recompute: str, compiled: bool = False) -> Seconds:
    """The routed experts of one MoE layer over ``copies`` token copies on this GPU (its
    tokens x top_k on average under expert parallelism; x the routing imbalance on the
    busiest rank): 6 FLOPs per expert weight per copy (each copy passes one expert, of
    expert_params / n_experts weights), at the matmul speed -- TP does not split them (every tp
    rank routes the same tokens). Element-wise per copy: SwiGLU on moe_hidden (10 bytes per
    element eager, 6 compiled, as `_bytes_per_token`) and the copy's gather, its weighting
    and its return to token order (12 bytes per dim)."""
    mm = 6 * m.expert_params / m.n_experts * copies
    mem = ((6 if compiled else 10) * m.moe_hidden + 12 * m.dim) * copies
    k_mm, _, k_mem = {"none": (3, 0, 3), "full": (4, 0, 4), "op": (3, 0, 4)}[recompute]
    return Seconds(matmul=mm * k_mm / 3 / (gpu.peak_bf16_flops * gpu.matmul_efficiency),
                   memory=mem * k_mem / gpu.hbm_bandwidth)
