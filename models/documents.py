"""Packed documents: per-token positions that restart at 0 where each document starts,
and the attention mask they imply -- causal inside a document, nothing across two.

A packed sequence carries its boundaries as ``positions`` [b, s] (int64): 0, 1, 2, ... in
each document, 0 again at the next one (training/sft.py makes them for packed records,
padding being a document of its own; training/loader.py's split_documents for the
EOS-separated documents of a pretraining window). So one small tensor gives both what rotary / learned position embeddings
read and where attention must stop, and it is what transformers' ``position_ids`` are: a
Hugging Face model given them detects the documents itself (masking_utils'
find_packed_sequence_indices).

The mask is a boolean [b, 1, s, s] for torch's scaled_dot_product_attention, not a
FlexAttention block mask: measured on CPU (torch 2.13), FlexAttention has no backward
there (NotImplementedError), so it cannot train on the machines the tests run on, while
SDPA with a boolean mask trains everywhere and on CPU costs 1.9x (seq 2048) to 2.7x (seq
8192) a causal attention call alone (bench/document_masking.py times the whole step).
``positions=None`` everywhere keeps the plain causal path (``is_causal=True``), as fast
as before.
"""

from __future__ import annotations

import torch


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions -> [b, s] document index: a new document wherever a position is 0."""
    return (positions == 0).cumsum(dim=-1)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions -> bool [b, 1, s, s]: query i may attend to key j iff j <= i and
    both are in the same document (True = attend, SDPA's convention). Every token sees at
    least itself, so no row is all False (which SDPA would turn into NaN)."""
    doc = document_ids(positions)
    s = positions.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (doc[:, None, :, None] == doc[:, None, None, :]) & causal
