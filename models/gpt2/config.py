"""GPT-2 / GPT-3 shapes: the config dataclass and the published flavors (torch-free, like
models/llama/config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPT2Config:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50_304  # GPT-2's 50,257 padded to a multiple of 64
    max_seq_len: int = 1024  # rows of the learned position embedding
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.dim


# GPT-2 (Radford et al. 2019) and the GPT-3 shapes (Brown et al. 2020; 175B is also the
# largest model of the PyTorch FSDP paper's table). "debug" is ours: tiny, TP up to 8.
FLAVORS: dict[str, GPT2Config] = {
    "debug": GPT2Config(dim=128, n_layers=4, n_heads=8, vocab_size=256, max_seq_len=512),
    "124M": GPT2Config(dim=768, n_layers=12, n_heads=12),
    "350M": GPT2Config(dim=1024, n_layers=24, n_heads=16),
    "774M": GPT2Config(dim=1280, n_layers=36, n_heads=20),
    "1.5B": GPT2Config(dim=1600, n_layers=48, n_heads=25),
    "6.7B": GPT2Config(dim=4096, n_layers=32, n_heads=32, max_seq_len=2048),
    "13B": GPT2Config(dim=5120, n_layers=40, n_heads=40, max_seq_len=2048),
    "175B": GPT2Config(dim=12_288, n_layers=96, n_heads=96, max_seq_len=2048),
}
