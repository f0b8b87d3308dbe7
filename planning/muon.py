"""What `[optimizer] name = "Muon"` costs a step, as training/muon.py runs it: Newton-Schulz
on whole matrices, the two all-to-alls that bring them to their owners and back, and the
memory the step holds meanwhile. docs/planning.md, Muon, derives each term.

Distribution (training/muon.py): the hidden matrices of one shape are stacked and
redistributed so each of the W ranks that shard them (FSDP's dp_shard x cp, times tp)
owns ceil(k / W) whole matrices, k padded with zero matrices to a multiple of W. DTensor
runs one all-to-all per sharding mesh dimension, each over the rank's whole local stack
(its shard of the k padded matrices), and the same again to return the results.

Newton-Schulz (torch.optim._muon._zeropower_via_newtonschulz), on an m x n matrix turned
so m <= n, per iteration: X X^T (2 m^2 n FLOPs), then addmm(A, A, A) (2 m^3) and
addmm(X, B, X) (2 m^2 n): 4 m^2 n + 2 m^3, bf16, `ns_steps` iterations (5 by default).

Groups are by shape and layout, as training/muon.py forms them: under TP a colwise and a
rowwise matrix of one shape (Llama's wq and wo) are sharded differently, so two groups,
each padded to a multiple of W on its own; without TP all are sharded alike and one shape
is one group.
"""

from __future__ import annotations

import math

from meshtrain.parallel.layout import ParallelDims
from meshtrain.planning.shape import Job, shard_degree
from meshtrain.planning.shares import RankShare

BF16 = 2


def hidden_shapes(model, output_layer: str) -> tuple[float, tuple]:
    """(the fraction of the trained parameters Muon updates, ((rows, cols, count, tp style),
    ...) of its matrices): Job.muon and Job.muon_shapes of a model (on meta) and its output
    layer. The tp style is the name of the ParallelStyle the model's TP plan gives the
    matrix's module ("ColwiseParallel", "RowwiseParallel"; "" where it has none)."""
    from collections import Counter

    from meshtrain.training.muon import hidden_matrices

    plan = model.tp_plan()
    styles = {id(p): type(plan[name]).__name__ if name in plan else ""
              for name, module in model.named_modules() for p in module.parameters(recurse=False)}
    hidden = hidden_matrices(model, output_layer)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shapes = Counter((*p.shape, styles.get(id(p), "")) for p in hidden)
    return sum(p.numel() for p in hidden) / trained, tuple((r, c, k, s) for (r, c, s), k in sorted(shapes.items()))


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of torch's Newton-Schulz on one rows x cols matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def owners(lay: ParallelDims) -> int:
    """W: the ranks a hidden matrix is split over and its stack is spread over."""
    return shard_degree(lay) * lay.tp


def rank_groups(job: Job, lay: ParallelDims, share: RankShare) -> list[tuple[int, int, int]]:
    """(rows, cols, padded k) of each group on a pipeline rank holding ``share``: matrices of
    one shape, and under TP of one TP style. job.muon_shapes counts the whole model's hidden
    matrices, all inside blocks, so a rank holds its layers' share of them."""
    from collections import Counter

    w = owners(lay)
    groups = Counter()
    for r, c, k, style in job.muon_shapes:
        groups[(r, c, style if lay.tp > 1 else "")] += k
    return [(r, c, math.ceil(round(k * share.layers / job.model.n_layers) / w) * w)
            for (r, c, _), k in sorted(groups.items())]


def compute_seconds(job: Job, lay: ParallelDims, share: RankShare) -> float:
    """Newton-Schulz on the ceil(k / W) matrices of each group this rank owns, at the matmul speed."""
    w, gpu = owners(lay), job.gpu
    flops = sum(k // w * newton_schulz_flops(r, c, job.ns_steps) for r, c, k in rank_groups(job, lay, share))
    return flops / (gpu.peak_bf16_flops * gpu.matmul_efficiency)


def all_to_all(job: Job, lay: ParallelDims, share: RankShare) -> tuple[dict[str, float], float]:
    """Bytes one rank sends per step in Muon's all-to-alls, by mesh dimension, and their
    time on the topology: per group and sharding dimension d (of size W_d) two all-to-alls
    of the rank's bf16 stack (k_pad r c / W elements), each sending (W_d - 1) / W_d of it."""
    w = owners(lay)
    dims = [(d, size, stride) for d, size, stride in (("dp_shard", shard_degree(lay), lay.tp), ("tp", lay.tp, 1))
            if size > 1]
    sent, seconds = {}, 0.0
    for r, c, k in rank_groups(job, lay, share):
        stack = BF16 * k * r * c / w
        for d, size, stride in dims:
            sent[d] = sent.get(d, 0.0) + 2 * stack * (size - 1) / size
            seconds += 2 * job.net.seconds("all-to-all", stack, size, stride)
    return sent, seconds


def step_transient(job: Job, lay: ParallelDims, share: RankShare) -> float:
    """Bytes Muon's step holds beyond the model states, at its worst: the bf16 update of
    every hidden shard (held until all are orthogonalised), one matrix's Newton-Schulz
    temporaries (the bf16 X and its next value, X X^T and its update: 2 m n + 2 m^2), and
    copies of the largest group's stack (k_pad r c / W bf16 elements each) on its way back:
    the stacked shards, the owned matrices, their results, and in the all-to-all (the GPU
    op: pack, all_to_all_single, unpack) its packed input, what it receives and the
    unpacked result -- plus, with two sharding mesh dimensions, the stack between the two.
    5 + (sharding dimensions) copies."""
    if not job.muon_shapes:
        return 0.0
    w = owners(lay)
    groups = rank_groups(job, lay, share)
    updates = BF16 * sum(k * r * c for r, c, k in groups) / w
    r, c, k = max(groups, key=lambda g: g[0] * g[1] * g[2])
    m, n = min(r, c), max(r, c)
    copies = 5 + sum(size > 1 for size in (shard_degree(lay), lay.tp))
    return updates + copies * BF16 * k * r * c / w + BF16 * (2 * m * n + 2 * m * m)
