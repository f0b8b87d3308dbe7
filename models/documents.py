"""Packed documents: per-token positions that restart at 0 where each document starts,
and the attention mask they imply -- causal inside a document, nothing across two.

A packed sequence carries its boundaries as ``positions`` [b, s] (int64): 0, 1, 2, ... in
each document, 0 again at the next one (training/sft.py makes them for packed records,
padding being a document of its own; training/loader.py's split_documents for the
EOS-separated documents of a pretraining window). So one small tensor gives both what rotary / learned position embeddings
read and where attention must stop, and it is what transformers' ``position_ids`` are: a
Hugging Face model given them detects the documents itself (masking_utils'
find_packed_sequence_indices).

Two kernels, one mask. On CUDA the mask is a FlexAttention ``BlockMask`` and attention runs
as compiled ``flex_attention``: it skips the blocks that lie wholly across two documents, so
a sequence of many short documents costs less than one causal attention over it (measured
on an H100: bench/gpu_check.py's document masking rows, docs/finetuning.md). Elsewhere it is
a boolean [b, 1, s, s] for torch's scaled_dot_product_attention: FlexAttention has no
backward on CPU (torch 2.13: NotImplementedError), and SDPA with a boolean mask trains
everywhere, at 1.9x (seq 2048) to 2.7x (seq 8192) a causal attention call on CPU. Both say
the same thing (tests/test_document_masking.py compares their outputs). ``positions=None``
everywhere keeps the plain causal path (``is_causal=True``), as fast as before.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

# False: the boolean SDPA mask on CUDA too (bench/document_masking.py times the two).
flex_on_cuda = True


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions -> [b, s] document index: a new document wherever a position is 0."""
    return (positions == 0).cumsum(dim=-1)


def document_mask(positions: torch.Tensor) -> torch.Tensor | BlockMask:
    """The mask the attention kernel of ``positions``' device takes (parallel/context_parallel.py's
    causal_attention runs either): a FlexAttention BlockMask on CUDA, else a boolean SDPA
    mask. The dry run's fake tensors get the boolean mask (its memory is the larger)."""
    if positions.is_cuda and flex_on_cuda and not is_fake(positions):
        return document_block_mask(positions)
    return document_bool_mask(positions)


def document_bool_mask(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions -> bool [b, 1, s, s]: query i may attend to key j iff j <= i and
    both are in the same document (True = attend, SDPA's convention). Every token sees at
    least itself, so no row is all False (which SDPA would turn into NaN)."""
    doc = document_ids(positions)
    s = positions.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (doc[:, None, :, None] == doc[:, None, None, :]) & causal


def document_block_mask(positions: torch.Tensor) -> BlockMask:
    """The same rule as a FlexAttention BlockMask (every head alike): built once per batch,
    shared by every layer; blocks of 128 x 128 that lie across two documents are skipped."""
    doc = document_ids(positions)
    b, s = positions.shape

    def same_document_causal(batch, head, q, kv):
        return (doc[batch, q] == doc[batch, kv]) & (kv <= q)

    return create_block_mask(same_document_causal, b, None, s, s, device=positions.device,
                             _compile=positions.is_cuda)
