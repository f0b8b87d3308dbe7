"""Context parallelism, DeepSpeed-Ulysses style: each cp rank holds seq / cp tokens of every
sequence; attention trades that split for a split of the heads.

    q, k, v  [b, s/cp, h, d]  --all-to-all-->  [b, s, h/cp, d]   causal SDPA over the whole sequence
    out      [b, s, h/cp, d]  --all-to-all-->  [b, s/cp, h, d]   back to this rank's tokens

Everything else in a block (norms, MLP, the projections) works token by token, so it runs
on the rank's own tokens unchanged. Each all-to-all moves (cp - 1) / cp of the tensor, over
the cp group: 4 of them per layer in forward (q, k, v, out), as many in backward. It needs
nothing from the attention kernel, so it runs on any backend (gloo included).

A model takes part through a plain attribute: every module with a ``context_parallel``
attribute (None by default) gets the `SequenceSplit` of the cp group from `apply_cp`; its
attention calls `causal_attention(q, k, v, self.context_parallel)` (which exchanges around
SDPA when the split is set), and a module that adds learned positions offsets them by
`SequenceSplit.offset`. Packed documents (models/documents.py): the model is given the
positions of the *whole* sequence ([b, s], not split), since attention -- the mask and
the rotary angles -- runs over the whole sequence after the exchange; a module with
learned positions looks up its own piece (`split_sequence`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from meshtrain.parallel.mesh import LayoutError


class SequenceSplit:
    """This rank's share of the sequence over the cp group, and the two all-to-alls."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.group = cp_mesh.get_group()
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def offset(self, local_len: int) -> int:
        """Global position of this rank's first token (sequences are cut in equal pieces)."""
        return self.rank * local_len

    def heads_for_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """[b, s/cp, heads, d] each -> [b, s, heads/cp, d]. With grouped-query attention and
        fewer kv heads than cp, the kv heads are repeated first so that each rank receives
        the ones its query heads read (`kv_repeats`)."""
        repeats = kv_repeats(q.shape[2], k.shape[2], self.size)
        if repeats > 1:
            k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        return tuple(self._exchange(t, "b s (cp h) d -> cp h b s d", "cp h b s d -> b (cp s) h d") for t in (q, k, v))

    def sequence_for_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[b, s, heads/cp, d] -> [b, s/cp, heads, d]: back to this rank's tokens."""
        return self._exchange(out, "b (cp s) h d -> cp h b s d", "cp h b s d -> b s (cp h) d")

    def _exchange(self, t: torch.Tensor, send: str, receive: str) -> torch.Tensor:
        # all_to_all_single sends the i-th slice of dim 0 to rank i and stacks what it
        # receives from rank i at i; its backward is the reverse exchange.
        chunks = rearrange(t, send, cp=self.size).contiguous()
        out = all_to_all_single_autograd(chunks, None, None, group=self.group)
        return rearrange(out, receive, cp=self.size)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit | None,
                     rotate=None, mask: torch.Tensor | None = None, **sdpa_kwargs) -> torch.Tensor:
    """Causal SDPA of q, k, v [b, s, heads, d] -> [b, s, heads, d], exchanging heads for
    the whole sequence first when ``split`` (context parallelism) is given, and back after.
    ``rotate(q, k)``: position encoding applied to the whole sequence (so with global
    positions), e.g. rotary. ``mask``: a boolean [b, 1, s, s] over the *whole* sequence
    (models/documents.py), or the same as a FlexAttention BlockMask (CUDA), used instead
    of the plain causal mask; under context
    parallelism it holds as it is, since each rank attends over the whole sequence."""
    if split is not None:
        q, k, v = split.heads_for_sequence(q, k, v)
    if rotate is not None:
        q, k = rotate(q, k)
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa_kwargs)
    elif isinstance(mask, BlockMask):  # packed documents on CUDA: the blocks across documents skipped
        out = compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=sdpa_kwargs.get("enable_gqa", False))
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_kwargs)
    out = rearrange(out, "b h s d -> b s h d")
    return split.sequence_for_heads(out) if split is not None else out


_flex = None


def compiled_flex_attention():
    """flex_attention compiled once per process: uncompiled it materialises the whole score
    matrix, the cost it exists to avoid."""
    global _flex
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def kv_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """How often to repeat each kv head so the kv heads split over cp in step with the
    query heads: the fewest repeats that make the count divisible by cp, while each rank's
    query heads still form whole groups over its kv heads. 1: no repeat."""
    if kv_heads % cp == 0:
        return 1
    repeats = cp // math.gcd(kv_heads, cp)
    group = q_heads // kv_heads
    return repeats if group % repeats == 0 else group  # else every query head gets its own copy


def split_sequence(t: torch.Tensor, split: SequenceSplit | None) -> torch.Tensor:
    """This rank's contiguous piece of dim 1 (the sequence) of ``t``."""
    if split is None:
        return t
    return t.chunk(split.size, dim=1)[split.rank]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> SequenceSplit:
    """Give every module with a ``context_parallel`` attribute the cp group's split."""
    split = SequenceSplit(cp_mesh)
    taking_part = [m for m in model.modules() if hasattr(m, "context_parallel")]
    if not taking_part:
        raise LayoutError(f"cp = {cp_mesh.size()}: {type(model).__name__} has no module with a context_parallel "
                          "attribute (its attention must exchange heads for sequence; see parallel/context_parallel.py)")
    for module in taking_part:
        module.context_parallel = split
    return split


def check_cp_fits(cp: int, tp: int, *, heads: int, seq_len: int, sequence_parallel: bool) -> list[str]:
    """What a cp degree needs of the model and the sequence, as problems (empty: fits)."""
    if cp == 1:
        return []
    problems = []
    if heads % (tp * cp):
        problems.append(f"heads ({heads}) are not divisible by tp*cp = {tp}*{cp} = {tp * cp}: each cp rank runs "
                        "attention for heads / (tp*cp) of them")
    per = cp * tp if sequence_parallel and tp > 1 else cp
    if seq_len % per:
        how = f"cp*tp = {cp}*{tp} (sequence parallel splits each piece again)" if per != cp else f"cp = {cp}"
        problems.append(f"seq_len = {seq_len} is not divisible by {how}")
    return problems
