"""LoRA: low-rank adapters on a model's nn.Linear layers, every base weight frozen.

    y = base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / rank

It lives in parallel/, beside float8.py, because like float8 it is a module swap over
nn.Linear layers found by name, applied to any model before TP and FSDP, and it knows no
model (the targets are name patterns from the config). What needs care is parallel's:
how tensor parallelism splits an adapter so that it follows its base layer
(`lora_tp_plan`), and that FSDP and the optimizer see frozen weights as frozen (they
have ``requires_grad=False``: autograd makes no gradient for them, training/optim.py
gives them no optimizer state, FSDP2 reduces no gradient for them, and clipping skips
parameters without a gradient).

Names follow PEFT's, so a PEFT adapter folder maps onto the model by dropping
".default" (training/lora_files.py): ``...q_proj.base_layer.weight`` (the frozen
weight; `parallel.init.canonical_name` drops "base_layer.", so its seed, Hugging Face
name and exported name stay those of the plain model), ``...q_proj.lora_A.default.weight``
[rank, in] (kaiming-uniform, as PEFT) and ``...q_proj.lora_B.default.weight`` [out, rank]
(zeros: a fresh adapter changes nothing until trained).
"""

from __future__ import annotations

import difflib
import math

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                              SequenceParallel)

from meshtrain.parallel.init import canonical_name, init_param_

ADAPTER = "default"        # PEFT's name of the one adapter; kept in parameter names
ALL_LINEAR = "all-linear"  # PEFT's word: every Linear but the output layer


class LoraError(ValueError):
    """LoRA settings that do not fit the model; the message names what would."""


class LoraLinear(nn.Module):
    """An nn.Linear (``base_layer``, frozen) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base_layer = base
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(dropout) if dropout else nn.Identity()})
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(base.in_features, rank, bias=False, **like)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(rank, base.out_features, bias=False, **like)})
        self.scaling = alpha / rank
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PEFT's order of operations, so the two agree to the last bit in one process.
        update = self.lora_B[ADAPTER](self.lora_A[ADAPTER](self.lora_dropout[ADAPTER](x)))
        return self.base_layer(x) + update * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.lora_A[ADAPTER].out_features}, scaling={self.scaling:g}"


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (trainable) rather than a base weight."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def lora_targets(model: nn.Module, patterns: list[str], exclude: tuple[str, ...] = ()) -> list[str]:
    """The paths of the nn.Linear modules ``patterns`` name, PEFT's way: a pattern matches
    a module whose path is the pattern or ends with "." + pattern; "all-linear" matches
    every Linear but those whose last name is in ``exclude`` (the output layer). A pattern
    that matches no Linear is refused, with the nearest Linear names."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not patterns:
        raise LoraError("target_modules is empty: name the Linear layers to adapt, or \"all-linear\"")
    found, problems = {}, []
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            hits = [n for n in linears if n.rsplit(".", 1)[-1] not in exclude]
        else:
            hits = [n for n in linears if n == pattern or n.endswith("." + pattern)]
        if hits:
            found.update(dict.fromkeys(hits))
            continue
        others = [n for n, m in model.named_modules() if n == pattern or n.endswith("." + pattern)]
        if others:
            kind = type(model.get_submodule(others[0]))
            problems.append(f"{pattern!r} names {others[0]}, a {kind.__module__}.{kind.__qualname__}, not an "
                            "nn.Linear (LoRA adapts Linear layers only)")
            continue
        ends = sorted({_pattern_of(n) for n in linears} | {n.rsplit(".", 1)[-1] for n in linears})
        near = difflib.get_close_matches(pattern, ends, n=3, cutoff=0.4)
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
        hint = f"nearest: {', '.join(near)}; " if near else ""
        problems.append(f"{pattern!r} matches no nn.Linear of {type(model).__name__} ({hint}its Linear "
                        f"layers are named {', '.join(leaves)}, or \"{ALL_LINEAR}\")")
    if problems:
        raise LoraError("; ".join(problems))
    return list(found)


def _pattern_of(path: str) -> str:
    """A module path with layer indices dropped: "model.layers.3.mlp.up_proj" -> "mlp.up_proj"."""
    parts = path.split(".")
    last_index = max((i for i, p in enumerate(parts) if p.isdigit()), default=-1)
    return ".".join(parts[last_index + 1:])


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: list[str], exclude: tuple[str, ...] = ()) -> list[str]:
    """Freeze every parameter of ``model``, then wrap each targeted nn.Linear in a
    `LoraLinear` whose adapters train. Call it on the whole model (on meta is fine), before
    TP and FSDP. Returns the wrapped modules' paths."""
    if rank < 1:
        raise LoraError(f"rank = {rank}: the adapters' rank must be at least 1")
    paths = lora_targets(model, target_modules, exclude)
    for p in model.parameters():
        p.requires_grad_(False)
    for path in paths:
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, LoraLinear(getattr(owner, attr), rank, alpha, dropout))
    return paths


def lora_paths(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, LoraLinear)]


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int) -> None:
    """A: kaiming-uniform (a = sqrt(5)), PEFT's and nn.Linear's default; B: zeros. Each
    drawn whole from (seed, name), so every layout starts from the same adapters."""
    for name, param in model.named_parameters():
        name = canonical_name(name)
        if ".lora_A." in name:
            init_param_(param, seed, name, lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g))
        elif ".lora_B." in name:
            init_param_(param, seed, name, lambda t, g: t.zero_())


def lora_tp_plan(model: nn.Module, plan: dict) -> dict:
    """``plan`` (pattern -> style, from the model, written for it unwrapped) with each entry
    that names wrapped Linear layers replaced by entries that split the adapters to follow
    their base layer:

    colwise base (weight split by output rows): A replicated, B split by output rows too.
        Each rank computes A x whole (r numbers per token) and its slice of B A x, exactly
        the slice of the base output it holds; A's gradient, a sum over all output rows,
        is all-reduced where lora_B takes its input (ColwiseParallel's input backward).
    rowwise base (weight split by input columns): A split by input columns, B replicated.
        A x is a partial sum per rank, reduced as the base output is (all-reduce, or
        reduce-scatter to the sequence shards under sequence parallelism); B then runs on
        whatever the base output is: replicated, or sequence-sharded (SequenceParallel:
        its weight replicated, its gradient summed over the shards).

    The base layer keeps its own style; the wrapper takes over the input redistribution
    so base and adapter see the same input."""
    wrapped = set(lora_paths(model))
    if not wrapped:
        return plan
    from meshtrain.parallel.tensor_parallel import plan_key_matches

    paths = [name for name, _ in model.named_modules()]
    out = {}
    for key, style in plan.items():
        matched = [p for p in paths if plan_key_matches(key, p)] if any(c in key for c in "*?[") else [key]
        hits = [p for p in matched if p in wrapped]
        if not hits:
            out[key] = style
            continue
        if len(hits) < len(matched):  # some wrapped, some not: spell each one out
            for p in matched:
                out.update(_split(p, style) if p in wrapped else {p: style})
        else:
            out.update(_split(key, style))
    return out


def _split(key: str, style) -> dict:
    a, b = f"{key}.lora_A.{ADAPTER}", f"{key}.lora_B.{ADAPTER}"
    if type(style) is ColwiseParallel:
        output, local = style.output_layouts[0], style.use_local_output
        # The wrapper hands base and adapter the same plain, whole input; the two from_local
        # steps inside (base, lora_B) each all-reduce their input gradient in backward.
        entries = {key: PrepareModuleInput(input_layouts=style.input_layouts, desired_input_layouts=(Replicate(),),
                                           use_local_output=True)}
        return {**entries, f"{key}.base_layer": ColwiseParallel(output_layouts=output, use_local_output=local),
                b: ColwiseParallel(output_layouts=output, use_local_output=local)}
    if type(style) is RowwiseParallel:
        output, local = style.output_layouts[0], style.use_local_output
        entries = {key: PrepareModuleInput(input_layouts=style.input_layouts, desired_input_layouts=(Shard(-1),),
                                           use_local_output=True)}
        entries[f"{key}.base_layer"] = RowwiseParallel(output_layouts=output, use_local_output=local)
        if isinstance(output, Shard):
            entries[a] = RowwiseParallel(output_layouts=output, use_local_output=False)
            entries[b] = SequenceParallel(sequence_dim=output.dim, use_local_output=local)
            return entries
        if not local:
            raise LoraError(f"{key}: LoRA under a RowwiseParallel style that keeps a replicated DTensor output "
                            "is not supported; leave this layer out of [lora] target_modules")
        entries[a] = RowwiseParallel(output_layouts=output, use_local_output=True)
        return entries  # B stays a plain, replicated Linear: its input and gradient are the same on every rank
    raise LoraError(f"{key}: the TP plan splits this layer with {type(style).__name__}, and LoRA adapters "
                    "follow only ColwiseParallel and RowwiseParallel bases; leave it out of [lora] "
                    "target_modules, or out of the TP plan")
