"""AdamW with decoupled weight decay (or Muon for the hidden matrices, training/muon.py,
and AdamW for the rest), and the learning-rate schedule.

Step convention: ``step`` is the number of optimizer steps already taken, 0-based, which
is what LambdaLR passes (its ``last_epoch``). The lr at ``step`` is the lr used by the
(step+1)-th ``optimizer.step()``. Training runs steps 0 .. total_steps-1.

    warmup   steps 0 .. warmup_steps-1: lr rises linearly, (step+1)/warmup_steps, so the
             first step already moves (lr/warmup_steps, never 0) and the last warmup step
             is at the peak.
    decay    from `decay_start` (still at the peak) to the last step, total_steps-1,
             which is at min_lr_ratio * peak. Steps past the end stay at the minimum.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtrain.training.muon import ShardedMuon, hidden_matrices

DECAY_TYPES = ("cosine", "linear", "constant", "wsd")


def build_optimizer(model: nn.Module, *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, leave_out: frozenset[int] = frozenset()) -> torch.optim.AdamW | None:
    """AdamW with two param groups: [0] matrices and embeddings (ndim >= 2) get weight
    decay, [1] norms and biases (ndim < 2) do not -- decaying a norm's gain toward zero
    only fights the normalisation. Frozen parameters (the base of a LoRA run) are left
    out: no moments are kept for them. Both groups exist whenever something trains in
    them, so group indices are the same for every model (and every checkpoint) of a kind;
    a LoRA run, whose adapters are all matrices, has the first alone (torch's flattened
    optimizer state dict cannot hold an empty group). ``leave_out``: ids of parameters
    another optimizer (Muon) updates; None when nothing is left for AdamW."""
    # DTensor.ndim is the global ndim, so sharding (a 1-D shard of a matrix) cannot move
    # a parameter from one group to the other.
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in leave_out]
    if not params:
        return None
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if not no_decay and len(params) < sum(1 for _ in model.parameters()):
        groups = groups[:1]
    elif not decay:
        groups = groups[1:]
    # fused: one kernel per group of tensors that reads each parameter, gradient and both
    # moments once. The foreach path instead materialises list-sized temporaries (a full
    # extra copy of the second moments, for one), which is both slower and a step-time
    # memory peak. DTensor parameters (FSDP shards, TP shards) take the fused path too.
    return torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps, fused=True)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, decay_type: str,
              min_lr_ratio: float, decay_ratio: float) -> float:
    """Multiplier in [0, 1] of the peak lr at 0-based ``step`` (see the module docstring).

    cosine / linear: decay over every step after warmup.
    constant:        the peak forever (min_lr_ratio is ignored).
    wsd:             warmup-stable-decay: flat at the peak, then linear to the minimum
                     over the last ``round(decay_ratio * total_steps)`` steps (never
                     reaching into warmup). Decaying only at the end keeps the run
                     resumable/extendable from any checkpoint taken on the plateau.
    """
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"unknown decay_type {decay_type!r}; expected one of {', '.join(DECAY_TYPES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant":
        return 1.0

    if decay_type == "wsd":
        decay_start = max(warmup_steps, total_steps - round(decay_ratio * total_steps))
    else:
        decay_start = warmup_steps
    span = total_steps - 1 - decay_start  # decay_start is at the peak, total_steps-1 at the minimum
    if span <= 0:  # no room to decay: the last step (and anything after) is at the minimum
        progress = 1.0 if step >= total_steps - 1 else 0.0
    else:
        progress = min(1.0, max(0.0, (step - decay_start) / span))

    if decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear, wsd
        shape = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                       decay_type: str, min_lr_ratio: float,
                       decay_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over every param group; call ``scheduler.step()`` after ``optimizer.step()``."""
    if decay_type not in DECAY_TYPES:  # fail at build time, not on the first step
        raise ValueError(f"unknown decay_type {decay_type!r}; expected one of {', '.join(DECAY_TYPES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0 or not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio and decay_ratio must be in [0, 1], got {min_lr_ratio}, {decay_ratio}")

    def fn(step: int) -> float:
        return lr_lambda(step, warmup_steps=warmup_steps, total_steps=total_steps,
                         decay_type=decay_type, min_lr_ratio=min_lr_ratio, decay_ratio=decay_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class Optimizers:
    """The optimizers of each model part (the pipeline stages on this rank; one part
    without a pipeline), stepped as one: AdamW, or with ``name="Muon"`` Muon for the part's
    hidden matrices and AdamW for the rest (``muon``: torch.optim.Muon's settings beyond
    lr and weight_decay, which both share). Per part because a checkpoint keys optimizer
    state by parameter name, and torch's state-dict API maps an optimizer's parameters to
    the names of one module: a part's names are the whole model's, whatever the cut.
    ``per_part[i]``: part i's optimizers; ``optimizers``: all of them."""

    def __init__(self, parts: list[nn.Module], *, name: str = "AdamW", output_layer: str = "output",
                 muon: dict | None = None, **adamw):
        self.parts = list(parts)
        self.per_part = []
        for part in self.parts:
            hidden = hidden_matrices(part, output_layer) if name == "Muon" else []
            mine = [ShardedMuon(hidden, lr=adamw["lr"], weight_decay=adamw["weight_decay"], **(muon or {}))] \
                if hidden else []
            rest = build_optimizer(part, **adamw, leave_out=frozenset(id(p) for p in hidden))
            self.per_part.append(mine + ([rest] if rest is not None else []))
        self.optimizers = [opt for opts in self.per_part for opt in opts]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


class Schedulers:
    """The same LR schedule on each of `Optimizers`' optimizers."""

    def __init__(self, optimizers: Optimizers, **schedule):
        self.schedulers = [build_lr_scheduler(opt, **schedule) for opt in optimizers.optimizers]

    def step(self) -> None:
        for sched in self.schedulers:
            sched.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    @property
    def peak_lr(self) -> float:
        return self.schedulers[0].base_lrs[0]

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()  # identical for every part

    def load_state_dict(self, state: dict) -> None:
        """Resume the schedule at the saved step, with this run's peak lr: the saved state
        holds the peak lr of the run that wrote it (``base_lrs``), and a rerun with a lower
        [optimizer] lr -- the usual answer to a non-finite stop -- must train at that lr,
        not silently at the old one. Warmup and decay follow this run's config too (the
        schedule function is this run's), so the config wins throughout."""
        for sched in self.schedulers:
            state = {**state, "base_lrs": list(sched.base_lrs)}
            sched.load_state_dict(state)
            # The saved lr of the saved step was the old peak's; LambdaLR sets the lr only
            # on step(), and the next optimizer step must already use the resumed step's
            # lr at this run's peak, not the first step's nor the old run's.
            sched._last_lr = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
            for group, lr in zip(sched.optimizer.param_groups, sched._last_lr):
                group["lr"] = lr
