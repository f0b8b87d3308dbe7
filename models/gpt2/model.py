"""GPT-2 / GPT-3 (the minGPT architecture): learned position embeddings, pre-LayerNorm
blocks with biases, GELU MLP of 4x width, and the output layer tied to the token
embedding.

Like models/llama, attention derives its head count from the *local* width of its
projections, so one forward runs on full weights and on tensor-parallel shards alike.
q, k and v are separate Linears (not GPT-2's fused c_attn) so that splitting each by
output columns gives every TP rank whole heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from meshtrain.models.common import build_from_flavor, cut_stage, fsdp_units
from meshtrain.models.gpt2.config import FLAVORS, GPT2Config
from meshtrain.models.documents import document_mask
from meshtrain.parallel.context_parallel import causal_attention, split_sequence
from meshtrain.parallel.init import canonical_name, init_param_, materialize, trunc_normal_
from meshtrain.parallel.lora import init_adapters_


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.context_parallel = None  # set by parallel.context_parallel.apply_cp

    def forward(self, x, mask=None):
        q, k, v = (rearrange(w(x), "b s (h d) -> b s h d", d=self.head_dim) for w in (self.wq, self.wk, self.wv))
        out = causal_attention(q, k, v, self.context_parallel, mask=mask)
        return self.wo(rearrange(out, "b s h d -> b s (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.ffn_hidden)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, mask=None):
        # mask by keyword: the TP plan prepares the positional input (x) only.
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Token ids [b, s] -> logits [b, s, vocab]; on pipeline stages after the first, hidden
    states [b, s, dim] -> hidden states (or logits on the last).

    The output layer's weight *is* the token embedding's (one Parameter under two names).
    Tensor parallelism keeps them one (see parallel.tensor_parallel); on a pipeline the
    first and last stage each hold a copy whose gradients are summed every step (see
    parallel.tied)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.context_parallel = None  # set by apply_cp: positions then start at this rank's offset

    @classmethod
    def from_flavor(cls, flavor: str, *, meta: bool = False, **overrides) -> "GPT2":
        return build_from_flavor(cls, FLAVORS, "GPT-2", flavor, meta=meta, overrides=overrides)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` [b, s] (the whole sequence's, also under context parallelism):
        packed documents (models/documents.py) -- each token's position looked up, attention
        inside each document only. None: one document per sequence, as before."""
        if self.wte is not None:
            # Under context parallelism the tokens are this rank's piece of each sequence.
            start = self.context_parallel.offset(tokens.shape[1]) if self.context_parallel is not None else 0
            if start + tokens.shape[1] > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {start + tokens.shape[1]} tokens, but the position embedding "
                                 f"has {self.cfg.max_seq_len} rows (max_seq_len)")
            if positions is None:
                # [1, s]: the position lookup's output is [1, s, dim], sharded like the tokens'.
                local = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
            else:
                local = split_sequence(positions, self.context_parallel)  # this rank's piece
            h = self.wte(tokens) + self.wpe(local)
        else:
            h = tokens
        mask = document_mask(positions) if positions is not None else None
        for layer in self.layers.values():
            h = layer(h, mask=mask)
        if self.lm_head is None:
            return h
        return self.lm_head(self.ln_f(h))

    # ---- what parallel/ needs to know about this model ----

    def fsdp_units(self) -> list[nn.Module | list[nn.Module]]:
        """Each block alone; token and position embeddings together, final norm and output
        together, and the two as one unit when both are on this stage (the tied weight
        must live in exactly one unit)."""
        return fsdp_units(self.layers.values(), [self.wte, self.wpe], [self.ln_f, self.lm_head],
                          tied=self.cfg.tie_embeddings)

    def transformer_blocks(self) -> nn.ModuleDict:
        return self.layers

    def tied_weights(self) -> list[tuple[str, ...]]:
        """Parameter names that hold one weight. On a pipeline the names may sit on
        different stages; the first is the one counted in the gradient norm."""
        return [("wte.weight", "lm_head.weight")] if self.cfg.tie_embeddings else []

    def pipeline_stage(self, layer_ids: list[int], *, first: bool, last: bool) -> "GPT2":
        """A copy with only ``layer_ids``, the embeddings if ``first``, the final norm and
        output if ``last``. Call it on the meta model. With tied weights the last stage's
        ``lm_head.weight`` becomes its own copy (initialized like ``wte.weight``)."""
        drop = ([] if first else ["wte", "wpe"]) + ([] if last else ["ln_f", "lm_head"])
        return cut_stage(self, layer_ids, drop=drop)

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        from meshtrain.models.gpt2.tp_plan import gpt2_tp_plan

        return gpt2_tp_plan(self, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def tp_divisible(self) -> dict[str, int]:
        c = self.cfg
        return {"heads": c.n_heads, "FFN width": c.ffn_hidden, "vocab size": c.vocab_size,
                "max_seq_len (position embedding rows)": c.max_seq_len}

    # ---- initialization: the same full weights whatever the layout ----

    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        """GPT-2's scheme: N(0, 0.02) for matrices and embeddings, scaled by 1/sqrt(2L) on
        the projections into the residual stream; zero biases; unit LayerNorm gains. A
        copy of a tied weight is drawn under its source's name, so it starts identical."""
        materialize(self, device)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        alias = {copy_: names[0] for names in self.tied_weights() for copy_ in names[1:]}
        with torch.no_grad():
            for name, param in self.named_parameters():
                name = canonical_name(alias.get(name, name))
                if name.endswith(".bias"):
                    init_param_(param, seed, name, lambda t, g: t.zero_())
                elif ".ln_" in name or name.startswith("ln_"):
                    init_param_(param, seed, name, lambda t, g: t.fill_(1.0))
                elif name.endswith(("attn.wo.weight", "mlp.proj.weight")):
                    init_param_(param, seed, name, lambda t, g: trunc_normal_(t, residual_std, g))
                else:
                    init_param_(param, seed, name, lambda t, g: trunc_normal_(t, 0.02, g))
            init_adapters_(self, seed)  # LoRA's own init, where [lora] added adapters
