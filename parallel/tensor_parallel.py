"""Tensor parallelism: apply a model's plan over the tp sub-mesh; the parallel loss."""

from __future__ import annotations

import contextlib
import difflib
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, loss_parallel,
                                              parallelize_module)

from meshtrain.parallel.init import retie, tied_parameter_names
from meshtrain.parallel.mesh import LayoutError

# The modules ColwiseParallel / RowwiseParallel know how to split: they shard the weight
# as torch stores it, [out, in] for a Linear and [vocab, dim] for an Embedding. Anything
# else (e.g. a Conv1D that stores [in, out]) would be split along the wrong dimension,
# or fail halfway through the plan.
SPLITTABLE = (nn.Linear, nn.Embedding)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> nn.Module:
    """Shard ``model`` in place by ``plan`` (module-name pattern -> ParallelStyle;
    names may use ``*`` wildcards, e.g. "layers.*.attention.wq").

    Tied parameters (one Parameter under several names, e.g. a token embedding reused
    as the output layer) stay tied: each style replaces its module's weight with a new
    DTensor, which would silently give every name its own copy, so afterwards every name
    is pointed back at the first one's. The plan must give them the same placements.

    A plan that would not do what it says is refused before anything is sharded
    (`check_tp_plan`)."""
    check_tp_plan(model, plan)
    tied = tied_parameter_names(model)
    # Some styles (SequenceParallel) make each weight a new nn.Parameter, trainable: a
    # frozen one (a LoRA run's base) must stay frozen.
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    parallelize_module(model, tp_mesh, plan)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    for names in tied:
        source = model.get_parameter(names[0])
        for name in names[1:]:
            copy = model.get_parameter(name)
            if getattr(copy, "placements", None) != getattr(source, "placements", None):
                raise ValueError(f"tied parameters {names[0]} and {name} get different tensor-parallel "
                                 f"placements ({getattr(source, 'placements', 'not sharded')} vs "
                                 f"{getattr(copy, 'placements', 'not sharded')}); the TP plan must shard "
                                 "them alike (e.g. RowwiseParallel embedding + ColwiseParallel output)")
    retie(model, tied)
    return model


def check_tp_plan(model: nn.Module, plan: dict) -> None:
    """Refuse, before anything is sharded, a plan that would not do what it says.
    ``parallelize_module`` skips a key that matches no module with a warning, so a plan
    written for another root (Hugging Face's ``layers.*.q_proj`` on a model whose layers
    sit under ``model.``) trains with no TP at all; and a style on a module it cannot
    split fails after the modules before it are already sharded."""
    if not isinstance(plan, dict):
        raise LayoutError(f"tp_plan must be a dict of module-name pattern -> ParallelStyle, "
                          f"got a {type(plan).__name__}")
    paths = [name for name, _ in model.named_modules()]
    known = set(paths)
    problems = []
    for key, style in plan.items():
        if any(c in key for c in "*?["):
            matched = [path for path in paths if plan_key_matches(key, path)]
        else:  # a plain path (models/ spell out every layer's): a lookup, not a scan
            matched = [key] if key in known else []
        if not isinstance(style, (ParallelStyle, dict)):
            # e.g. the strings of a Hugging Face config's base_model_tp_plan ("colwise").
            problems.append(f"{key!r}: {style!r} is not a ParallelStyle (ColwiseParallel(), "
                            "RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...), ...)")
        elif not matched:
            near = nearest_paths(key, paths)
            hint = f"nearest module paths: {', '.join(near)}" if near else "no module path is close"
            problems.append(f"{key!r} matches no module of {type(model).__name__} (keys are paths from "
                            f"the module given to parallelize; {hint})")
        elif isinstance(style, (ColwiseParallel, RowwiseParallel)):
            wrong = [path for path in matched if not isinstance(model.get_submodule(path), SPLITTABLE)]
            if wrong:
                more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
                kind = type(model.get_submodule(wrong[0]))
                problems.append(
                    f"{key!r}: {type(style).__name__} cannot split {wrong[0]}{more}, a "
                    f"{kind.__module__}.{kind.__qualname__}: it shards only nn.Linear and nn.Embedding "
                    "weights (stored [out, in] / [vocab, dim]); replace the module by an nn.Linear, "
                    "or leave it out of the TP plan (FSDP still shards it)")
    if problems:
        raise LayoutError("tp_plan refused, nothing was sharded:\n  " + "\n  ".join(problems))


def plan_key_matches(key: str, path: str) -> bool:
    """Whether a TP plan key names the module at dotted ``path``, as ``parallelize_module``
    reads it: one fnmatch pattern per path segment ("layers.*.wq" matches "layers.0.wq",
    not "layers.0.sub.wq"); the empty key is the root."""
    patterns, segments = key.split(".") if key else [], path.split(".") if path else []
    return len(patterns) == len(segments) and all(map(fnmatchcase, segments, patterns))


def nearest_paths(key: str, paths: list[str], n: int = 3) -> list[str]:
    """The module paths most like ``key``, written as patterns: a layer index becomes
    ``*``, so "model.layers.0.self_attn.q_proj" and its 31 siblings are one suggestion."""
    patterns = dict.fromkeys(".".join("*" if s.isdigit() else s for s in p.split(".")) for p in paths if p)
    return difflib.get_close_matches(key, list(patterns), n=n, cutoff=0.5)


def loss_parallel_context(enabled: bool):
    """Cross-entropy on vocab-sharded logits without gathering them: each rank computes
    its slice of the log-sum-exp and one all-reduce combines them. Forward *and*
    backward of the loss must run inside this context."""
    return loss_parallel() if enabled else contextlib.nullcontext()
