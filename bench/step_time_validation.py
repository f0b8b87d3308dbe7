"""The planner's step time against measured ones: ours on an H100, torchtitan's, Megatron-LM's.

    python bench/step_time_validation.py [--markdown]

Each row is a run whose settings its source states (docs/planning.md, "Validation", names
the sources and what they leave unstated), estimated with planning.estimate.estimate exactly
as the search would, and printed beside the measured tokens/s per GPU with the error.
The estimate is not fitted to these rows: the kernel speeds come from physics/gpus.py
(a measured matmul and copy bandwidth, the published flash-attention efficiency).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from meshtrain.planning.estimate import estimate
from meshtrain.parallel import ParallelDims
from meshtrain.planning.shape import Job, ModelShape
from meshtrain.physics.gpus import get_gpu

H100 = get_gpu("h100-80gb")
RUN5 = ROOT / "bench/results/2026-11-22_h100_run5.json"


def llama(flavor: str, n_layers: int | None = None) -> ModelShape:
    m = ModelShape.from_flavor(flavor, 128_256, "llama")
    return dataclasses.replace(m, n_layers=n_layers) if n_layers else m


def megatron_gpt(dim: int, heads: int, layers: int) -> ModelShape:
    """Megatron's GPT of the weak-scaling table: 4h GeLU MLP, multi-head attention,
    learned positions, untied output layer, vocabulary 131,072, sequence 4,096."""
    from meshtrain.models.gpt2.model import GPT2

    m = GPT2.from_flavor("124M", meta=True, dim=dim, n_heads=heads, n_layers=1, vocab_size=131_072,
                         max_seq_len=4096, tie_embeddings=False)
    return ModelShape.from_model(m, flavor=f"megatron-{dim}", n_layers=layers, family="gpt2",
                                 learned_positions=True)


def ours() -> list[dict]:
    """bench/gpu_check.py on one H100 SXM 80GB (700 W): Llama 3 8B's block, 10 layers, one
    8192-token sequence per step, matmul measured in the same run."""
    result = json.loads(RUN5.read_text())
    gpu = dataclasses.replace(H100, matmul_efficiency=result["matmul_tflops"] * 1e12 / H100.peak_bf16_flops)
    rows = []
    for run in result["runs"]:
        if run["float8"]:
            continue
        job = Job(llama("8B", result["shape"]["layers"]), gpu, 1, 1, 8192, 1, compiled=run["compile"])
        lay = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=1, world_size=1, strategy="FULL_SHARD", ac=run["ac"],
                           micro_batch=1)
        rows.append(dict(source="meshtrain, bench/results run5", run=f"8B-shape, 10 layers, 1 GPU, {run['name']}",
                         job=job, layout=lay, measured=run["tokens_per_second"]))
    return rows


def torchtitan() -> list[dict]:
    """benchmarks/llama3_h100_202412_torchtitan.md (Tables 1, 3), asyncTP_llama3_h100_2025-06,
    docs/performance.md @ 3faaa1a0d (405B): the bf16 rows. Their GPUs: H100 96 GB HBM2e at
    500 W (2024-12, 2025-06), "lower TDP" 94/95 GB (405B); estimated as an H100 SXM 80GB."""
    rows = []

    def add(run, model, nodes, seq, batch, compiled, measured, **lay):
        job = Job(model, H100, nodes, 8, seq, batch, compiled=compiled)
        rows.append(dict(source="torchtitan", run=run, job=job, layout=ParallelDims(dp_replicate=1, pp=1, world_size=job.world, **lay),
                         measured=measured))

    fsdp8 = dict(tp=1, dp_shard=8, strategy="FULL_SHARD", ac="op", micro_batch=2)
    add("8B, FSDP 8, local batch 2, per-op SAC, eager", llama("8B"), 1, 8192, 16, False, 5762, **fsdp8)
    add("8B, FSDP 8, local batch 2, per-op SAC, compiled", llama("8B"), 1, 8192, 16, True, 6667, **fsdp8)
    fsdp128 = dict(tp=1, dp_shard=128, strategy="FULL_SHARD", ac="op", micro_batch=2)
    add("8B, FSDP 128, local batch 2, per-op SAC, eager", llama("8B"), 16, 8192, 256, False, 5605, **fsdp128)
    add("8B, FSDP 128, local batch 2, per-op SAC, compiled", llama("8B"), 16, 8192, 256, True, 6514, **fsdp128)
    add("8B, FSDP 8 x TP 8, local batch 12, per-op SAC, compiled", llama("8B"), 8, 8192, 96, True, 4378,
        tp=8, dp_shard=8, strategy="FULL_SHARD", ac="op", micro_batch=12)
    add("70B, FSDP 32 x TP 8, local batch 16, full AC, compiled", llama("70B"), 32, 8192, 512, True, 597.3,
        tp=8, dp_shard=32, strategy="FULL_SHARD", ac="full", micro_batch=16)
    add("405B, FSDP 16 x TP 8, local batch 2, full AC, compile (preset; not stated)", llama("405B"), 16, 8192, 32,
        True, 109,
        tp=8, dp_shard=16, strategy="FULL_SHARD", ac="full", micro_batch=2)
    return rows


MEGATRON = [  # size, heads, hidden, layers, TP, PP, GPUs, global batch, TFLOP/s per GPU (README table)
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def megatron() -> list[dict]:
    """Megatron-LM README, weak scaling on H100 (Megatron-Core r0.8): TFLOP/s per GPU by
    Megatron's own count (full attention, logits, no recomputation), compared as such."""
    rows = []
    for size, heads, dim, layers, tp, pp, gpus, batch, tflops in MEGATRON:
        m = megatron_gpt(dim, heads, layers)
        job = Job(m, H100, gpus // 8, 8, 4096, batch, compiled=True)  # fused kernels (Transformer Engine)
        dp = gpus // (tp * pp)
        local = batch // dp
        pipe = dict(pp=pp, pp_schedule="1F1B", pp_microbatches=local, stages_per_rank=1) if pp > 1 else dict(pp=1)
        # Micro-batch size is not stated. Megatron reduces gradients once per step (after
        # all micro-batches), which the planner's pp = 1 layouts do only when the local
        # batch is one micro-batch; under a pipeline, micro-batches of one sequence.
        lay = ParallelDims(tp=tp, dp_replicate=1, dp_shard=dp, world_size=job.world, strategy="SHARD_GRAD_OP",
                           ac="none", micro_batch=1 if pp > 1 else local, **pipe)
        flops = megatron_flops_per_token(m, 4096)
        rows.append(dict(source="Megatron-LM", run=f"GPT {size}, TP {tp} x PP {pp} x DP {dp}, batch {batch}",
                         job=job, layout=lay, measured=tflops * 1e12 / flops))
    return rows


def megatron_flops_per_token(m: ModelShape, s: int) -> float:
    """Megatron's num_floating_point_operations per token (training.py): 72·L·h²·(1 + s/(6h) + V/(12·L·h))
    for a 4h MLP without GQA; the table's TFLOP/s divided by it gives tokens/s."""
    L, h, V = m.n_layers, m.dim, m.vocab
    return 72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends it quietly
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    rows = ours() + torchtitan() + megatron()
    if args.markdown:
        print("| source | run | measured tok/s/GPU | estimated | error |\n|---|---|---:|---:|---:|")
    for r in rows:
        e = estimate(r["job"], r["layout"])
        err = e.tokens_per_s_per_gpu / r["measured"] - 1
        r["estimated"], r["error"] = e.tokens_per_s_per_gpu, err
        if args.markdown:
            print(f"| {r['source']} | {r['run']} | {r['measured']:,.0f} | {e.tokens_per_s_per_gpu:,.0f} | {err:+.0%} |")
        else:
            print(f"{r['source']:<32} {r['run']:<60} {r['measured']:>9,.0f} {e.tokens_per_s_per_gpu:>9,.0f} {err:+6.0%}")


if __name__ == "__main__":
    main()
