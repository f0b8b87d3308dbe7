"""transformers' routed experts as the expert-parallel contract of models/registry.py.

In transformers 5.x a mixture-of-experts layer (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, ...)
holds its routed experts as one module of two stacked weights,

    gate_up_proj [E, 2 * I, H]    each expert's gate and up projections, concatenated
    down_proj    [E, H, I]

marked by `@use_experts_implementation` (the flags it sets say the layout), and its router
calls it as ``experts(hidden_states, top_k_index, top_k_weights)``. Expert parallelism
(parallel/expert_parallel.py) wants a module called as ``forward(x_sorted,
tokens_per_expert)`` whose weights lead with the experts. `RoutedExperts`, mixed in before
the experts' class, is both: its ``__call__`` keeps transformers' signature -- sort the
token copies by expert, run the module (where expert parallelism's all-to-alls hook in),
weigh each copy and add it back onto its token -- and its ``forward`` is the experts over
rows already grouped by expert. The router, shared experts and everything else stay
transformers' code; parameter names stay the Hugging Face ones. The call also counts the
token copies its router sent each expert (`take_loads`: the moe/ load statistics, as
models/moe/ counts them).

Experts in another layout (transposed or biased weights as gpt-oss keeps them, a list of
expert MLPs, DBRX's flattened weights) are left as transformers runs them: FSDP gathers
them whole, and ``ep > 1`` is refused naming them (`unknown_experts`).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.models.moe.experts import grouped_linear, local
from meshtrain.models.moe.loads import counts_this_forward

# What @use_experts_implementation records on an experts module, for the layout RoutedExperts computes.
FUSED_LAYOUT = dict(has_gate=True, is_concatenated=True, is_transposed=False, has_bias=False,
                    has_post_expert_norm=False)


class RoutedExperts:
    """Mixed in before a transformers experts class (see the module docstring)."""

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        n_experts, k = self.gate_up_proj.shape[0], top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        # A stable sort keeps token order inside each expert's group: each expert's rows are
        # one contiguous slice, as the grouped matmul and the all-to-all want them.
        order = flat.argsort(stable=True)
        source = order // k  # the token each sorted copy came from
        tokens_per_expert = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
        tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: its size is data
        if counts_this_forward(hidden_states):  # not again when activation checkpointing recomputes
            with torch.no_grad():
                counted = getattr(self, "_mt_loads", None)
                self._mt_loads = tokens_per_expert if counted is None else counted + tokens_per_expert
        routed = nn.Module.__call__(self, hidden_states[source], tokens_per_expert)  # with expert parallelism's hooks
        # Back in token order (a permutation: no atomic adds, as models/moe/layer.py's
        # combine), then each token's k copies weighed and summed.
        unsorted = torch.empty_like(routed).index_copy(0, order, routed).view(-1, k, routed.shape[-1])
        out = (unsorted * top_k_weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)
        return out.to(hidden_states.dtype)

    def take_loads(self) -> torch.Tensor:
        """[n_experts]: the token copies this rank's router sent each expert since the last
        call, and start counting afresh. (A plain attribute, not a buffer: it is no part of
        the weights transformers, checkpoints or expert parallelism's sharding handle.)"""
        counted, self._mt_loads = getattr(self, "_mt_loads", None), None
        if counted is None:
            counted = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int64, device=local(self.gate_up_proj).device)
        return counted

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert (``tokens_per_expert[e]`` of them for the e-th expert this
        rank holds) -> each through its expert: down(gate(x) (act) up(x))."""
        gate_up, down = local(self.gate_up_proj), local(self.down_proj)
        hidden = self._apply_gate(grouped_linear(x_sorted, gate_up, tokens_per_expert))  # transformers' gating
        return grouped_linear(hidden, down, tokens_per_expert)


def is_experts(name: str, module: nn.Module) -> bool:
    """Whether ``module`` holds a layer's routed experts: marked by transformers'
    @use_experts_implementation, or by its name (an "experts" attribute, a class named
    "...Experts") for architectures that predate or bypass it."""
    marked = all(hasattr(module, flag) for flag in FUSED_LAYOUT)
    return marked or name.rpartition(".")[2] == "experts" or type(module).__name__.endswith("Experts")


def layout_problem(module: nn.Module) -> str | None:
    """Why ``module``'s experts are not in the layout `RoutedExperts` computes, or None."""
    if isinstance(module, RoutedExperts):
        return None
    flags = {flag: getattr(module, flag, None) for flag in FUSED_LAYOUT}
    differ = [f"{flag}={value}" for flag, value in flags.items() if value != FUSED_LAYOUT[flag]]
    if differ:
        return ", ".join(differ) if all(v is not None for v in flags.values()) else "not transformers' fused experts"
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"}:
        return f"weights {', '.join(sorted(params))} (not gate_up_proj and down_proj)"
    (e, two_i, h), (e2, h2, i) = params["gate_up_proj"].shape, params["down_proj"].shape
    if e != e2 or two_i != 2 * i or h != h2:
        return f"gate_up_proj {tuple(params['gate_up_proj'].shape)} and down_proj {tuple(params['down_proj'].shape)}"
    return None


_CLASSES: dict[type, type] = {}


def route_experts_(model: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    """Turn every experts module of ``model`` in the fused layout into a `RoutedExperts`
    (in place: the class changes, the weights stay). Returns (those modules by name, a
    description of each experts module in another layout)."""
    routed, unknown = {}, []
    for name, module in model.named_modules():
        if not is_experts(name, module):
            continue
        problem = layout_problem(module)
        if problem is not None:
            unknown.append(f"{name} ({type(module).__name__}: {problem})")
            continue
        cls = type(module)
        if not issubclass(cls, RoutedExperts):
            if cls not in _CLASSES:
                _CLASSES[cls] = type(cls.__name__, (RoutedExperts, cls), {"__module__": cls.__module__})
            module.__class__ = _CLASSES[cls]
        routed[name] = module
    return routed, unknown


def plan_addresses(key: str, paths: list[str]) -> bool:
    """Whether TP plan ``key`` ("layers.*.mlp.experts.gate_up_proj") names one of the
    modules at ``paths`` ("layers.0.mlp.experts") or a parameter of one."""
    parts = key.split(".")
    for path in paths:
        segments = path.split(".")
        for candidate in (parts, parts[:-1]):
            if len(candidate) == len(segments) and all(c in ("*", s) for c, s in zip(candidate, segments)):
                return True
    return False


class StackedExperts:
    """The fused [E, rows, cols] weight of the experts at ``prefix``, read from a folder
    that stores each expert apart (transformers' save_pretrained and the Hub:
    "...experts.{e}.gate_proj.weight"): gate_up_proj is each expert's gate_proj and up_proj
    rows concatenated, down_proj its down_proj. Answers safetensors' slice calls
    (get_shape, [experts, rows, cols]) reading only the rows asked for."""

    PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

    def __init__(self, grid: list[list]):
        self.grid = grid  # per expert, its stored pieces (safetensors slices) in row order

    @classmethod
    def find(cls, name: str, files: dict, get_slice) -> "StackedExperts | None":
        prefix, _, leaf = name.rpartition(".")
        parts = cls.PARTS.get(leaf)
        if parts is None or f"{prefix}.0.{parts[0]}.weight" not in files:
            return None
        n = 0
        while all(f"{prefix}.{n}.{p}.weight" in files for p in parts):
            n += 1
        return cls([[get_slice(f"{prefix}.{e}.{p}.weight") for p in parts] for e in range(n)])

    def get_shape(self) -> list[int]:
        first = self.grid[0]
        return [len(self.grid), sum(p.get_shape()[0] for p in first), first[0].get_shape()[1]]

    def __getitem__(self, index: tuple[slice, slice, slice]) -> torch.Tensor:
        experts, rows, cols = index
        blocks = []
        for pieces in self.grid[experts]:
            parts, start = [], 0
            for piece in pieces:
                n = piece.get_shape()[0]
                lo, hi = max(rows.start - start, 0), min(rows.stop - start, n)
                if lo < hi:
                    parts.append(piece[lo:hi, cols])
                start += n
            blocks.append(torch.cat(parts))
        return torch.stack(blocks)
