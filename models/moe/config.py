"""Mixture-of-experts shapes: the config dataclass and the flavors. No torch here, so
reading a run config stays light.

A block is Llama's attention plus, for the first ``n_dense_layers``, Llama's dense SwiGLU
feed-forward (``ffn_hidden`` wide), else a mixture of ``n_experts`` SwiGLU experts
(``moe_hidden`` wide each) of which every token uses ``top_k``, plus optional shared experts
every token uses. Routing is dropless: no capacity, no token is ever dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    n_kv_heads: int | None = None    # None: as many kv heads as heads
    head_dim: int | None = None      # None: dim // n_heads (Qwen3 sets its own)
    vocab_size: int = 102_400
    ffn_hidden: int = 10_944         # the dense layers' SwiGLU width
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: tuple[float, float, float, int] | None = None  # Llama 3.1 style, see models/llama
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # ---- the mixture ----
    n_dense_layers: int = 1          # the first blocks keep a dense feed-forward (DeepSeek: first_k_dense_replace)
    n_experts: int = 64              # routed experts per MoE layer
    top_k: int = 6                   # experts each token is sent to
    moe_hidden: int = 1408           # each expert's SwiGLU width
    n_shared_experts: int = 0        # a dense SwiGLU n_shared_experts * moe_hidden wide, for every token
    score_func: str = "softmax"      # router scores: softmax over experts, or an independent sigmoid each
    route_norm: bool = True          # divide the top-k weights by their sum
    route_scale: float = 1.0         # then multiply them by this (DeepSeek-V3: 2.5)
    balance_loss_coef: float = 0.0   # auxiliary load-balance loss weight; 0: off
    bias_update_rate: float = 1e-3   # DeepSeek-V3's loss-free balancing bias step; 0: off

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        for key, problem in moe_problems(self):
            raise ValueError(f"{key} = {getattr(self, key)!r}: {problem}")


def moe_problems(cfg: MoEConfig) -> list[tuple[str, str]]:
    """(key, what is wrong) for each MoE setting that cannot work; [] when all is well.
    The config loader names the key and the file with these; the dataclass raises them."""
    out = []
    if cfg.n_experts < 1:
        out.append(("n_experts", "needs at least 1 expert"))
    if not 1 <= cfg.top_k <= max(cfg.n_experts, 1):
        out.append(("top_k", f"each token picks top_k of the n_experts = {cfg.n_experts} experts: "
                             f"use 1 to {cfg.n_experts}"))
    if cfg.score_func not in SCORE_FUNCS:
        out.append(("score_func", f"accepted: {', '.join(SCORE_FUNCS)}"))
    if not 0 <= cfg.n_dense_layers <= cfg.n_layers:
        out.append(("n_dense_layers", f"must be from 0 to n_layers = {cfg.n_layers}"))
    if cfg.balance_loss_coef < 0 or cfg.bias_update_rate < 0:
        key = "balance_loss_coef" if cfg.balance_loss_coef < 0 else "bias_update_rate"
        out.append((key, "must be >= 0 (0 turns it off)"))
    return out


# "debug" is ours: tiny, TP-friendly up to tp = 4 (heads, kv heads, dense width), a dense
# first layer, one shared expert, both balancing mechanisms on so every code path runs.
# The real shapes use plain GQA attention: DeepSeek's multi-head latent attention (MLA) and
# Qwen3's QK-norm are not implemented, nor DeepSeek-V3's group-limited routing (n_group,
# topk_group); parameter counts of the attention therefore differ from the published ones.
FLAVORS: dict[str, MoEConfig] = {
    "debug": MoEConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_hidden=256,
                       rope_theta=10_000.0, max_seq_len=512, n_dense_layers=1, n_experts=8, top_k=2,
                       moe_hidden=64, n_shared_experts=1, score_func="softmax", balance_loss_coef=0.01,
                       bias_update_rate=1e-3),
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): every layer MoE, 128 experts, top 8,
    # no shared expert, softmax scores, top-k renormalised (norm_topk_prob), aux loss 0.001.
    "qwen3_30b_a3b": MoEConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                               vocab_size=151_936, ffn_hidden=6144, rope_theta=1_000_000.0,
                               max_seq_len=40_960, n_dense_layers=0, n_experts=128, top_k=8,
                               moe_hidden=768, score_func="softmax", route_norm=True,
                               balance_loss_coef=0.001, bias_update_rate=0.0),
    # Qwen3-235B-A22B: for planning (meta only).
    "qwen3_235b_a22b": MoEConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                                 vocab_size=151_936, ffn_hidden=12_288, rope_theta=1_000_000.0,
                                 max_seq_len=40_960, n_dense_layers=0, n_experts=128, top_k=8,
                                 moe_hidden=1536, score_func="softmax", route_norm=True,
                                 balance_loss_coef=0.001, bias_update_rate=0.0),
    # DeepSeek-V3 671B: for planning (meta only). 3 dense layers, 256 routed experts + 1
    # shared, top 8, sigmoid scores, renormalised and scaled by 2.5, loss-free balancing
    # (bias step 0.001) plus a small sequence-wise balance loss (alpha 0.0001).
    "deepseek_v3_671b": MoEConfig(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128,
                                  vocab_size=129_280, ffn_hidden=18_432, rope_theta=10_000.0,
                                  max_seq_len=4096, n_dense_layers=3, n_experts=256, top_k=8,
                                  moe_hidden=2048, n_shared_experts=1, score_func="sigmoid",
                                  route_norm=True, route_scale=2.5, balance_loss_coef=0.0001,
                                  bias_update_rate=1e-3),
}
