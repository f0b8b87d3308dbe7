"""Llama 2/3 shapes: the config dataclass and the published flavors. No torch here, so
that reading a run config (and listing what it may name) stays light."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: no GQA (as many kv heads as heads)
    vocab_size: int = 128_256
    ffn_hidden: int = 14_336
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    # Llama 3.1 long-context frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None for plain RoPE.
    rope_scaling: tuple[float, float, float, int] | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) and "
                f"n_heads by n_kv_heads ({self.n_kv_heads})"
            )
        if (self.dim // self.n_heads) % 2:  # rotary turns pairs of a head's channels
            raise ValueError(f"the head size dim / n_heads = {self.dim} / {self.n_heads} = "
                             f"{self.dim // self.n_heads} must be even (rotary embeddings rotate pairs)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


_LLAMA31_SCALING = (8.0, 1.0, 4.0, 8192)

# Published shapes (Llama 3 family). "debug" is ours: tiny, GQA, TP-friendly up to tp=4.
FLAVORS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                         ffn_hidden=256, rope_theta=10_000.0, max_seq_len=512),
    "1B": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                      rope_scaling=(32.0, 1.0, 4.0, 8192), max_seq_len=131_072,
                      tie_embeddings=True),
    "8B": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14_336,
                      rope_scaling=_LLAMA31_SCALING, max_seq_len=131_072),
    "70B": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28_672,
                       rope_scaling=_LLAMA31_SCALING, max_seq_len=131_072),
    "405B": LlamaConfig(dim=16_384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_hidden=53_248, rope_scaling=_LLAMA31_SCALING, max_seq_len=131_072),
}
