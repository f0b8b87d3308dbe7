"""Cross-entropy that never holds an fp32 copy of the whole logits ([training] chunked_loss).

`F.cross_entropy(logits.float(), ...)` upcasts the [tokens, vocab] logits to fp32, keeps
their fp32 log-softmax for backward and, in backward, makes two more fp32 tensors of that
size: 12 bytes per logit at its peak (a 4-sequence micro-batch of 8,192 tokens over
Llama 3's 128,256 words: 50 GB). Here the forward goes through the logits CHUNK_ELEMENTS
at a time, upcasting one chunk, and keeps only the logits as they came (bf16) and one
fp32 log-sum-exp per token. The backward rebuilds each chunk's softmax from those and
writes the gradient in the logits' dtype. The peak is the logits and their gradient,
2 + 2 bytes per bf16 logit, plus one chunk's fp32 working set (flash-attn's and
llm-foundry's fused cross-entropy keep the same). The softmax is fp32 in both.

Vocab-sharded logits (TP with loss_parallel: a DTensor sharded on its last dimension)
are handled on the local shard: per chunk, one all-reduce of the row maxima and one of the
sums of exponentials and target logits over the TP group; the backward communicates
nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

IGNORE_INDEX = -100  # a label not trained on (F.cross_entropy's default, and transformers')

# fp32 elements per chunk (256 MiB per fp32 temporary): small next to the logits
# themselves at any vocabulary that matters, big enough that a chunk's kernels are
# matmul-sized (2,048 tokens of a 32K vocabulary, 512 of a 128K one).
CHUNK_ELEMENTS = 2**26


def chunk_tokens(vocab: int, chunk_elements: int | None = None) -> int:
    """Tokens per chunk for a (local) vocabulary of ``vocab`` words (CHUNK_ELEMENTS unless
    ``chunk_elements`` is given)."""
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(vocab, 1))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` [tokens, vocab or its local shard] against
    ``labels`` [tokens]; ``offset``: the global index of the shard's first word; ``group``:
    the process group the vocabulary is sharded over (None: not sharded)."""

    @staticmethod
    def forward(ctx, logits, labels, offset, group, chunk):
        n, v = logits.shape
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            x = logits[start:start + chunk].to(torch.float32, copy=True)  # the one fp32 chunk
            y = labels[start:start + chunk]
            local = y - offset
            here = (local >= 0) & (local < v) & (y != IGNORE_INDEX)
            target = torch.where(here, x.gather(1, local.clamp(0, v - 1).unsqueeze(1)).squeeze(1), 0.0)
            row_max = x.amax(dim=1)
            if group is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([x.sub_(row_max.unsqueeze(1)).exp_().sum(dim=1), target])
            if group is not None:
                dist.all_reduce(sums, group=group)  # the shards' exp-sums and the one target logit
            lse[start:start + chunk] = row_max + sums[0].log()
            counted = y != IGNORE_INDEX
            total += torch.where(counted, lse[start:start + chunk] - sums[1], 0.0).sum()
            del x  # before the next chunk's is made: one fp32 chunk at a time
        ctx.save_for_backward(logits, labels, lse)
        ctx.offset, ctx.chunk = offset, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        logits, labels, lse = ctx.saved_tensors
        n, v = logits.shape
        grad = torch.empty_like(logits)
        for start in range(0, n, ctx.chunk):
            y = labels[start:start + ctx.chunk]
            # copy=True: fp32 logits must not be overwritten by the in-place softmax below
            p = logits[start:start + ctx.chunk].to(torch.float32, copy=True)
            p.sub_(lse[start:start + ctx.chunk].unsqueeze(1)).exp_()  # softmax
            local = y - ctx.offset
            here = (local >= 0) & (local < v) & (y != IGNORE_INDEX)
            p.scatter_add_(1, local.clamp(0, v - 1).unsqueeze(1), -here.to(p.dtype).unsqueeze(1))
            p.mul_((grad_total * (y != IGNORE_INDEX)).unsqueeze(1))
            grad[start:start + ctx.chunk] = p
            del p
        return grad, None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                          chunk_elements: int | None = None) -> torch.Tensor:
    """`F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction=...,
    ignore_index=-100)` -- "sum" or "mean" (over the counted labels; NaN when none is,
    as F's) -- without the fp32 copy of the whole logits. ``logits`` [..., vocab] may be a
    DTensor sharded on the vocabulary (loss_parallel) or replicated over a 1-D mesh."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', not {reduction!r}")
    vocab = logits.shape[-1]  # the whole vocabulary's, also for a sharded DTensor
    offset, group, width = 0, None, vocab
    if isinstance(logits, DTensor):
        placements = tuple(logits.placements)
        if logits.device_mesh.ndim != 1 or placements[0] not in (Shard(logits.ndim - 1), Shard(-1), Replicate()):
            raise NotImplementedError(f"chunked_cross_entropy takes logits sharded on the vocabulary over a "
                                      f"1-D mesh, or replicated; these are {placements} over a "
                                      f"{logits.device_mesh.ndim}-D mesh")
        if placements[0] != Replicate():
            # Shard's split is torch.chunk's: ceil(vocab / ranks) words a rank, the last ones
            # fewer. Every rank cuts its chunks for that widest shard, so their all-reduces match.
            mesh = logits.device_mesh
            width = -(-vocab // mesh.size())
            offset, group = min(mesh.get_local_rank() * width, vocab), mesh.get_group()
            if width * (mesh.size() - 1) >= vocab:
                raise NotImplementedError(f"chunked_cross_entropy: {vocab} words over {mesh.size()} ranks leave the "
                                          f"last rank none (torch.chunk's split: {width} a rank)")
        logits = logits.to_local()  # its backward makes the gradient a DTensor with the same placement
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    logits, labels = logits.flatten(0, -2), labels.flatten()
    # F.cross_entropy refuses a label outside the vocabulary; the chunks would count it as
    # a target no shard holds. Asynchronous on a GPU: no wait for the check's result.
    torch._assert_async(((labels >= 0) & (labels < vocab) | (labels == IGNORE_INDEX)).all(),
                        f"chunked_cross_entropy: a label is outside the vocabulary [0, {vocab}) and not "
                        f"{IGNORE_INDEX} (ignored)")
    total = _ChunkedCrossEntropy.apply(logits, labels, offset, group, chunk_tokens(width, chunk_elements))
    if reduction == "sum":
        return total
    return total / (labels != IGNORE_INDEX).sum()
