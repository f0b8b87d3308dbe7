"""The mixture-of-experts transformer: Llama's attention, norms and rotary embeddings
(imported, not copied), a dense SwiGLU feed-forward in the first ``n_dense_layers`` blocks
and a mixture of experts (layer.py) in the rest.

Beyond the registry's contract (models/registry.py) it answers three optional calls the
step makes on any model that has them: `set_loss_scale` (so the balance loss weighs the
same in every layout), `after_optimizer_step` (the loss-free balancing bias, from the
loads of the step), and `metrics` (the moe/ scalars).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.models.common import build_from_flavor, cut_stage, fsdp_units
from meshtrain.models.llama.model import Attention, FeedForward, block_inputs, rotary_table
from meshtrain.models.moe.config import FLAVORS, MoEConfig
from meshtrain.models.moe.layer import MoE
from meshtrain.models.moe.loads import load_scalars, summed_loads
from meshtrain.parallel.init import init_param_, materialize, trunc_normal_


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg) if layer_id < cfg.n_dense_layers else MoE(cfg)

    def forward(self, x, angles, mask=None):
        h = x + self.attention(self.attention_norm(x), angles, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MoETransformer(nn.Module):
    """Token ids [b, s] -> logits [b, s, vocab]; laid out like models/llama's `Llama`
    (``layers`` keyed "0", "1", ...; ends None on middle pipeline stages)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(cfg.max_seq_len, cfg.head_dim // 2, 2), persistent=False)
        self.init_buffers()

    @classmethod
    def from_flavor(cls, flavor: str, *, meta: bool = False, **overrides) -> "MoETransformer":
        return build_from_flavor(cls, FLAVORS, "moe", flavor, meta=meta, overrides=overrides)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        angles, mask = block_inputs(self.rope, positions)
        for layer in self.layers.values():
            h = layer(h, angles, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    # ---- what parallel/ needs to know (the registry's contract) ----

    def fsdp_units(self) -> list:
        return fsdp_units(self.layers.values(), [self.tok_embeddings], [self.norm, self.output],
                          tied=self.cfg.tie_embeddings)

    def pipeline_stage(self, layer_ids: list[int], *, first: bool, last: bool) -> "MoETransformer":
        drop = ([] if first else ["tok_embeddings"]) + ([] if last else ["norm", "output"])
        return cut_stage(self, layer_ids, drop=drop)

    def transformer_blocks(self) -> nn.ModuleDict:
        return self.layers

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True):
        from meshtrain.models.moe.tp_plan import moe_tp_plan

        return moe_tp_plan(self, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def tied_weights(self) -> list[tuple[str, ...]]:
        return [("tok_embeddings.weight", "output.weight")] if self.cfg.tie_embeddings else []

    def tp_divisible(self) -> dict[str, int]:
        """TP splits attention, the dense and shared feed-forwards and the vocabulary; the
        routed experts are replicated over tp (each tp rank routes the same tokens)."""
        c = self.cfg
        sizes = {"heads": c.n_heads, "kv heads": c.n_kv_heads, "vocab size": c.vocab_size}
        if c.n_dense_layers:
            sizes["FFN width"] = c.ffn_hidden
        if c.n_shared_experts and c.n_dense_layers < c.n_layers:
            sizes["shared experts' width"] = c.n_shared_experts * c.moe_hidden
        return sizes

    def expert_modules(self) -> dict[str, nn.Module]:
        """The routed experts of each MoE layer on this part, by module name: what expert
        parallelism splits (each `GroupedExperts.forward(x_sorted, tokens_per_expert)`,
        weights [n_experts, ...])."""
        return {f"layers.{name}.feed_forward.experts": moe.experts for name, moe in self.moe_layers().items()}

    def ep_divisible(self) -> dict[str, int]:
        """What expert parallelism splits: the routed experts."""
        return {"routed experts": self.cfg.n_experts}

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (what
        MFU counts, training/metrics.py)."""
        total = sum(p.numel() for p in self.parameters())
        unused = sum(m.experts.w1[0].numel() * 3 * (m.n_experts - m.top_k) for m in self.moe_layers().values())
        return total - unused

    # ---- the optional calls of training/step.py ----

    def moe_layers(self) -> dict[str, MoE]:
        """This part's mixture-of-experts layers, by layer name."""
        return {name: block.feed_forward for name, block in self.layers.items() if isinstance(block.feed_forward, MoE)}

    def set_loss_scale(self, scale: float) -> None:
        """The factor the step multiplies summed token losses by (dp * cp / the global batch's
        counted tokens): the balance loss, weighted per token as well, becomes the mean over
        the global batch's sequences in every layout and accumulation."""
        for moe in self.moe_layers().values():
            moe.loss_scale = scale

    @torch.no_grad()
    def after_optimizer_step(self, sum_over=()) -> None:
        """Sum the step's expert loads over the data-parallel meshes ``sum_over`` (each rank
        routed its own tokens; tp ranks route the same ones, so tp is not among them), move
        each layer's bias by rate * sign(mean load - load) -- the same on every rank, as
        the loads are -- and keep the loads for `metrics`."""
        layers = self.moe_layers()
        if not layers:
            return
        loads = summed_loads([m.tokens_per_expert for m in layers.values()], sum_over)
        balance = torch.stack([m.balance_total for m in layers.values()])
        for mesh in sum_over:
            if mesh is not None:
                dist.all_reduce(balance, op=dist.ReduceOp.AVG, group=mesh.get_group())  # as the loss is
        for moe, load in zip(layers.values(), loads):
            if self.cfg.bias_update_rate > 0:
                moe.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load).to(moe.expert_bias.dtype)
            moe.tokens_per_expert.zero_()
            moe.balance_total.zero_()
        bias = torch.stack([m.expert_bias.abs().max() for m in layers.values()])
        self._last_step = (list(layers), loads, bias, balance)  # read (a device sync) only when logged

    def metrics(self) -> dict[str, float]:
        """The moe/ scalars of the last step (docs/moe.md). Tags several pipeline stages
        report (the balance loss, summed over layers; dropped tokens) add up."""
        if getattr(self, "_last_step", None) is None:
            return {}
        names, loads, bias, balance = self._last_step
        out = load_scalars(names, loads)
        if self.cfg.bias_update_rate > 0:
            out.update({f"moe/bias_max_abs/layer{name}": b for name, b in zip(names, bias.tolist())})
        if self.cfg.balance_loss_coef > 0:
            out["moe/balance_loss"] = balance.sum().item()
        out["moe/dropped_tokens"] = 0.0  # dropless routing: never one
        return out

    # ---- initialization: the same full weights whatever the layout ----

    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        materialize(self, device)
        c = self.cfg
        depth_std = 0.02 / math.sqrt(2 * c.n_layers)  # residual-branch outputs (GPT-2 scaling)
        with torch.no_grad():
            alias = {copy_: names[0] for names in self.tied_weights() for copy_ in names[1:]}
            for name, param in self.named_parameters():
                name = alias.get(name, name)
                if name.endswith("norm.weight"):
                    init_param_(param, seed, name, lambda t, g: t.fill_(1.0))
                elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                    init_param_(param, seed, name, _trunc_normal(depth_std))
                elif name.endswith("tok_embeddings.weight") and not c.tie_embeddings:
                    init_param_(param, seed, name, lambda t, g: t.normal_(0.0, 1.0, generator=g))
                elif name.endswith("output.weight"):
                    init_param_(param, seed, name, _trunc_normal(c.dim ** -0.5))
                else:
                    init_param_(param, seed, name, _trunc_normal(0.02))
            self.init_buffers()
            for moe in self.moe_layers().values():  # a fresh model: no bias, nothing counted
                for buffer in (moe.expert_bias, moe.tokens_per_expert, moe.balance_total):
                    buffer.zero_()

    def init_buffers(self) -> None:
        """Fill the rotary table (on meta this allocates and computes nothing)."""
        self.rope.copy_(rotary_table(self.cfg))


def _trunc_normal(std: float):
    return lambda t, g: trunc_normal_(t, std, g)
