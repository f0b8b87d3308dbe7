"""Llama 2/3: RMSNorm, rotary embeddings (with Llama 3.1 frequency scaling), grouped-query
attention through scaled_dot_product_attention, SwiGLU feed-forward.

Written so tensor parallelism needs no special code paths: attention and feed-forward
derive head counts from the *local* width of their projections, so the same forward runs
on full weights or on TP shards.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from meshtrain.models.common import build_from_flavor, cut_stage, fsdp_units
from meshtrain.models.documents import document_mask
from meshtrain.models.llama.config import FLAVORS, LlamaConfig
from meshtrain.parallel.context_parallel import causal_attention
from meshtrain.parallel.init import canonical_name, init_param_, materialize, trunc_normal_
from meshtrain.parallel.lora import init_adapters_


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama 3.1 scaling: long wavelengths are
    divided by `factor`, short ones kept, and a smooth blend in between."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if cfg.rope_scaling is None:
        return inv
    factor, low, high, original_len = cfg.rope_scaling
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = original_len / low, original_len / high
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > low_wavelen, inv / factor,
                       torch.where(wavelen < high_wavelen, inv, blended))


def rotary_table(cfg) -> torch.Tensor:
    """(cos, sin) of every position's angles, [max_seq_len, head_dim/2, 2], float32: the
    model's buffer. Real, so `model.to(dtype)` cannot drop half of it as it would a
    complex buffer's imaginary part."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), rope_frequencies(cfg))
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def rotary_angles(table: torch.Tensor) -> torch.Tensor:
    """The table as unit complex numbers cos + i sin, [max_seq_len, head_dim/2]: a view
    of it, made once per forward and passed to every block. Not a floating-point tensor,
    so FSDP's mixed precision does not cast a bf16 copy of it for each block (which each
    block's backward would then keep), and blocks save a view of the one table."""
    return torch.view_as_complex(table.float())


def block_inputs(table: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(angles, mask) every block of a forward takes: the whole table's angles, or with
    ``positions`` [b, s] (packed documents) each token's own and the documents' mask."""
    angles = rotary_angles(table)
    return (angles, None) if positions is None else (angles[positions], document_mask(positions))


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [b, s, h, d] by `angles` (unit
    complex numbers), [s, d/2] (the same positions in every sequence) or [b, s, d/2] (each
    token's own, packed documents) -- Meta's reference layout, so released weights load
    without permuting. Each pair read as one complex number, the rotation is one multiply:
    one kernel forward and one backward, where rotating the halves by hand takes eight
    (and a dry run traces each)."""
    pairs = torch.view_as_complex(rearrange(x.float(), "b s h (d two) -> b s h d two", two=2).contiguous())
    angles = angles[None, :, None] if angles.dim() == 2 else angles[:, :, None]
    return rearrange(torch.view_as_real(pairs * angles), "b s h d two -> b s h (d two)").type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.context_parallel = None  # set by parallel.context_parallel.apply_cp

    def forward(self, x, angles, mask=None):
        # Under TP these projections hold only this rank's heads; "(h d)" with d fixed
        # recovers the local head count, so no TP-specific code is needed here.
        q = rearrange(self.wq(x), "b s (h d) -> b s h d", d=self.head_dim)
        k = rearrange(self.wk(x), "b s (h d) -> b s h d", d=self.head_dim)
        v = rearrange(self.wv(x), "b s (h d) -> b s h d", d=self.head_dim)

        def rotate(q, k):
            # The angles come for every position up to max_seq_len: only here, after sequence
            # parallel and context parallel have gathered the sequence, is its length known.
            # Per-token angles ([b, s, d/2], packed documents) are already the whole sequence's.
            a = angles[: q.shape[1]] if angles.dim() == 2 else angles
            return apply_rope(q, a), apply_rope(k, a)

        out = causal_attention(q, k, v, self.context_parallel, rotate, mask=mask, enable_gqa=True)
        return self.wo(rearrange(out, "b s h d -> b s (h d)"))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, angles, mask=None):
        # mask by keyword: the TP plan prepares the positional inputs (x, angles) only.
        h = x + self.attention(self.attention_norm(x), angles, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token ids [b, s] -> logits [b, s, vocab].

    `layers` is a ModuleDict keyed "0", "1", ... so parameter names stay stable when a
    pipeline stage keeps only some layers, and so TP/FSDP plans can address blocks by name.
    `tok_embeddings`, `norm` and `output` may be None on middle pipeline stages.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The rotary table is derived data: not saved, so filled here (a model built by its
        # constructor runs, e.g. after load_state_dict of an export) and again by
        # init_weights after a meta model is materialized.
        self.register_buffer("rope", torch.empty(cfg.max_seq_len, cfg.head_dim // 2, 2), persistent=False)
        self.init_buffers()

    @classmethod
    def from_flavor(cls, flavor: str, *, meta: bool = False, **overrides) -> "Llama":
        """Build a published shape. ``meta=True`` allocates nothing: parallelize first,
        then `init_weights` materializes only this rank's shards."""
        return build_from_flavor(cls, FLAVORS, "Llama", flavor, meta=meta, overrides=overrides)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` are hidden states [b, s, dim] on pipeline stages after the first.
        ``positions`` [b, s] (the whole sequence's, also under context parallelism): packed
        documents (models/documents.py) -- rotary angles by each token's position and
        attention inside each document only. None: one document per sequence, as before."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        angles, mask = block_inputs(self.rope, positions)
        for layer in self.layers.values():
            h = layer(h, angles, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    # ---- what parallel/ needs to know about this model (and nothing more) ----

    def fsdp_units(self) -> list[nn.Module | list[nn.Module]]:
        """FSDP groups: embeddings, each block alone, norm + output together (see
        models.common.fsdp_units); tied embeddings and output share one group."""
        return fsdp_units(self.layers.values(), [self.tok_embeddings], [self.norm, self.output],
                          tied=self.cfg.tie_embeddings)

    def pipeline_stage(self, layer_ids: list[int], *, first: bool, last: bool) -> "Llama":
        """A copy holding only ``layer_ids`` (plus the embeddings if ``first``, the final
        norm and output if ``last``). Call it on the meta model, where copying is free.
        With tied embeddings the last stage's ``output.weight`` becomes its own copy,
        kept equal to the first stage's by parallel.tied."""
        drop = ([] if first else ["tok_embeddings"]) + ([] if last else ["norm", "output"])
        return cut_stage(self, layer_ids, drop=drop)

    def transformer_blocks(self) -> nn.ModuleDict:
        """The repeated blocks (activation checkpointing and compile wrap these)."""
        return self.layers

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True):
        from meshtrain.models.llama.tp_plan import llama_tp_plan

        return llama_tp_plan(self, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def tied_weights(self) -> list[tuple[str, ...]]:
        """Parameter names that hold one weight (the first is the one counted in the
        gradient norm when a pipeline splits them over two stages)."""
        return [("tok_embeddings.weight", "output.weight")] if self.cfg.tie_embeddings else []

    def tp_divisible(self) -> dict[str, int]:
        """Sizes that tensor parallelism splits, so each must be divisible by tp."""
        c = self.cfg
        return {"heads": c.n_heads, "kv heads": c.n_kv_heads, "FFN width": c.ffn_hidden,
                "vocab size": c.vocab_size}

    # ---- initialization: the same full weights whatever the layout ----

    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        """Materialize (if on meta) and initialize every parameter from (seed, name) alone.
        Each rank fills only its own shards; see parallel.init for how."""
        materialize(self, device)
        c = self.cfg
        depth_std = 0.02 / math.sqrt(2 * c.n_layers)  # residual-branch outputs (GPT-2 scaling)
        with torch.no_grad():
            alias = {copy_: names[0] for names in self.tied_weights() for copy_ in names[1:]}
            for name, param in self.named_parameters():
                name = canonical_name(alias.get(name, name))  # a tied copy starts as its source
                if name.endswith("norm.weight"):
                    init_param_(param, seed, name, lambda t, g: t.fill_(1.0))
                elif name.endswith(("wo.weight", "w2.weight")):
                    init_param_(param, seed, name, _trunc_normal(depth_std))
                elif name.endswith("tok_embeddings.weight") and not c.tie_embeddings:
                    init_param_(param, seed, name, lambda t, g: t.normal_(0.0, 1.0, generator=g))
                elif name.endswith("output.weight"):
                    init_param_(param, seed, name, _trunc_normal(c.dim ** -0.5))
                else:
                    init_param_(param, seed, name, _trunc_normal(0.02))
            init_adapters_(self, seed)  # LoRA's own init, where [lora] added adapters
            self.init_buffers()

    def init_buffers(self) -> None:
        """Fill the rotary table (on meta this allocates and computes nothing)."""
        self.rope.copy_(rotary_table(self.cfg))


def _trunc_normal(std: float):
    return lambda t, g: trunc_normal_(t, std, g)
