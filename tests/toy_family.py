"""A third model family that lives outside models/: a config, a model and one
`registry.register(FAMILY)` are all train.py needs (tests/test_registry.py trains it).
Attention-free on purpose: the point is the registry's contract, not the architecture.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.models import registry
from meshtrain.models.common import build_from_flavor, fsdp_units
from meshtrain.parallel.init import init_param_, materialize, trunc_normal_


@dataclass
class ToyConfig:
    dim: int = 64
    n_layers: int = 3
    hidden: int = 128
    vocab_size: int = 256
    max_seq_len: int = 4096  # no position table: any length works
    norm_eps: float = 1e-5
    n_heads: int = 1         # what MFU accounting and the planner ask of every family
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim

    @property
    def ffn_hidden(self) -> int:
        return self.hidden


FLAVORS = {"tiny": ToyConfig()}


class Block(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.head = nn.Sequential(nn.RMSNorm(cfg.dim, eps=cfg.norm_eps), nn.Linear(cfg.dim, cfg.vocab_size, bias=False))

    @classmethod
    def from_flavor(cls, flavor: str, *, meta: bool = False, **overrides) -> "Toy":
        return build_from_flavor(cls, FLAVORS, "toy", flavor, meta=meta, overrides=overrides)

    def forward(self, tokens):
        return self.head(functools.reduce(lambda h, layer: layer(h), self.layers.values(), self.embed(tokens)))

    def fsdp_units(self):
        return fsdp_units(self.layers.values(), [self.embed], [self.head], tied=False)

    def transformer_blocks(self):
        return self.layers

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        return {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}

    def tp_divisible(self) -> dict[str, int]:
        return {"hidden width": self.cfg.hidden}

    def tied_weights(self):
        return []

    def init_weights(self, seed: int = 0, device=None) -> None:
        materialize(self, device)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.ndim == 1:  # the norms' gains
                    init_param_(param, seed, name, lambda t, g: t.fill_(1.0))
                else:
                    std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith("down.weight") else 0.02
                    init_param_(param, seed, name, lambda t, g, std=std: trunc_normal_(t, std, g))


FAMILY = registry.Family("toy", "a test's attention-free toy", "tests.toy_family:ToyConfig",
                         "tests.toy_family:Toy", high_precision=("head.1",))
