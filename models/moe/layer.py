"""One mixture-of-experts feed-forward: route each token to its top-k experts, run every
expert over its tokens at once (experts.py), add the results weighted by the router.

    scores   = softmax(x W_r) or sigmoid(x W_r)                     [T, E], fp32
    chosen   = top_k(scores + expert_bias)                           selection only
    weights  = scores[chosen] (/ their sum if route_norm) * route_scale
    out      = sum_k weights_k * expert_{chosen_k}(x) (+ shared experts(x))

Dropless: every token reaches all of its top_k experts, whatever the load, so the result
of a token depends on that token alone -- and so not on the batch, the micro-batching or
the layout.

Balancing, two mechanisms, either or both (DeepSeek-V3 uses both):
- the loss-free bias (``bias_update_rate``): ``expert_bias`` is added to the scores for the
  choice only, and after each optimizer step moved by rate * sign(mean load - load) from the
  tokens each expert received during the step (the model's `after_optimizer_step`);
- the sequence-wise balance loss (``balance_loss_coef``): per sequence
  B = E * sum_e f_e * P_e, f_e the share of the sequence's token choices that went to e,
  P_e the mean normalised score of e (`sequence_balance`). Its
  mean over the global batch's sequences is added to the objective; the gradient is
  injected in backward (`AddBalanceLoss`), so the forward's output, the logits and the
  logged cross-entropy are untouched, and pipeline stages need no extra loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.models.moe.config import MoEConfig
from meshtrain.models.moe.experts import GroupedExperts, local
from meshtrain.models.moe.loads import counts_this_forward


class SwiGLU(nn.Module):
    """Llama's feed-forward at a given width (the shared experts)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        # A plain weight, not an nn.Linear: float8 training converts Linear layers, and the
        # choice of experts hinges on small score gaps.
        self.gate = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        self.top_k, self.score_func = cfg.top_k, cfg.score_func
        self.route_norm, self.route_scale = cfg.route_norm, cfg.route_scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor):
        """x [T, dim] -> (weights [T, k], chosen experts [T, k], scores [T, E]), fp32."""
        # At least fp32 whatever the compute dtype (bf16 under mixed precision): the choice
        # hinges on small gaps between scores.
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), local(self.gate).to(dtype))
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + expert_bias, self.top_k, dim=-1).indices  # the bias picks, never weighs
        weights = scores.gather(-1, chosen)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, chosen, scores


class AddBalanceLoss(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: ``out``'s gradient, and a gradient of 1 for
    ``loss`` -- as if ``loss`` had been added to the objective (Megatron-LM injects its
    auxiliary losses the same way), without changing what the model returns."""

    @staticmethod
    def forward(ctx, out, loss):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


def sequence_balance(chosen: torch.Tensor, scores: torch.Tensor, batch: int) -> torch.Tensor:
    """B [batch] of each sequence: E * sum_e f_e * P_e, where f_e = (choices of e) / (seq * k)
    and P_e = the mean over the sequence's tokens of e's score normalised over the experts
    (softmax scores already are; sigmoid scores are divided by their sum). 1 when perfectly
    balanced, E / k when every token picks the same k experts (Switch Transformer's loss,
    per sequence as DeepSeek-V3's)."""
    tokens, k = chosen.shape
    n_experts, seq = scores.shape[-1], tokens // batch
    picks = torch.zeros(batch, n_experts, device=scores.device, dtype=scores.dtype)
    picks.scatter_add_(1, chosen.reshape(batch, seq * k), torch.ones(batch, seq * k, device=scores.device,
                                                                       dtype=scores.dtype))
    share = picks / (seq * k)
    mean_score = (scores / scores.sum(dim=-1, keepdim=True)).reshape(batch, seq, n_experts).mean(dim=1)
    return n_experts * (share * mean_score).sum(dim=-1)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.balance_loss_coef = cfg.balance_loss_coef
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.moe_hidden)
        self.shared_experts = SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.moe_hidden) if cfg.n_shared_experts else None
        # Training state, saved with the weights: the loss-free balancing bias.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        # Observed since the last optimizer step (read and reset by after_optimizer_step).
        # (Integers: a float32 count stops being exact past 2^24 token copies per step.)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("balance_total", torch.zeros(()), persistent=False)
        # The factor the step multiplies summed token losses by (models' set_loss_scale);
        # None: the balance loss is the mean over this forward's sequences.
        self.loss_scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, chosen, scores = self.router(tokens, self.expert_bias)
        # Dispatch: the T * k token copies sorted by expert (a stable sort keeps token order
        # inside each expert's group), so each expert's rows are one contiguous slice.
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        source = order // self.top_k  # the token each sorted copy came from
        tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: its size is data
        routed = self.experts(tokens[source], tokens_per_expert)
        # Combine: the copies back in token order -- a permutation, so no two rows meet and
        # nothing is added atomically: the same bits every run on CUDA, and 1.37 against
        # index_add_'s 1.78 ms on an H100 Qwen3-30B-A3B layer (a tie on CPU;
        # bench/moe_layer_profile.py) -- then each token's k copies weighed and summed.
        unsorted = torch.empty_like(routed).index_copy(0, order, routed).view(batch * seq, self.top_k, dim)
        out = (unsorted * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.reshape(batch, seq, dim)
        if not torch.is_grad_enabled():
            return out  # evaluation: no loss to add, nothing to count
        scale = self.loss_scale if self.loss_scale is not None else 1.0 / (batch * seq)
        # Summed over sequences, each weighted by its tokens: times the step's scale, the
        # mean over the global batch's sequences, as the cross-entropy is over its tokens.
        balance = (sequence_balance(chosen, scores, batch) * seq).sum() * scale
        if counts_this_forward(x):  # not again when activation checkpointing recomputes in backward
            with torch.no_grad():
                self.tokens_per_expert += tokens_per_expert
                self.balance_total += balance.detach()
        if self.balance_loss_coef > 0:
            out = AddBalanceLoss.apply(out, self.balance_loss_coef * balance)
        return out

