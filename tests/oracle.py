"""The judge of every parity test: plain PyTorch, no meshtrain code.

A layout is right when it trains like this loop does: the model as an ordinary
nn.Module on one process, loaded with the layout's initial full weights;
`torch.optim.AdamW`; `torch.nn.utils.clip_grad_norm_`; `F.cross_entropy` over every token
of the global batch; the learning-rate schedule written out here, not imported;
micro-batches accumulated by hand. Nothing from parallel/ or training/ is used.

Tolerances come from an error model rather than from one machine's run. A layout changes
only the order in which fp32 sums are taken (sharded matmuls, reductions over ranks), so it
should land about as far from exact arithmetic as the fp32 reference itself does. The
reference is therefore trained three times, twice in fp32 with different summation orders
and once in fp64 (`Oracle.noise`): per parameter tensor, per step loss and gradient norm,
the largest distance among the three is the rounding scale of this problem on this
machine, and a layout may differ from the fp32 reference by at most `K` times it, plus a
few fp32 ulps. Adam makes the scale uneven -- it divides by
sqrt(v), so elements whose gradient is at the rounding floor move by up to the learning
rate on noise alone -- which is why the scale is measured per tensor instead of fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

K = 50  # the largest deviation measured, over every layout and CPU kernel path, is under K / 10 (test_parity.py)
ULP = torch.finfo(torch.float32).eps


def logits_of(output) -> torch.Tensor:
    """A model's logits, whether it returns them, an object with .logits or a dict."""
    if isinstance(output, torch.Tensor):
        return output
    return output["logits"] if isinstance(output, dict) else output.logits


def cosine_lr(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps (the first step already at lr/warmup),
    then cosine down to ``min_ratio * lr`` at the last step. ``step`` counts from 0."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = total - 1 - warmup
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the last step's (clipped, if clipping binds)


def train(model: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], *, lr: float,
          max_norm: float, weight_decay: float = 0.1, betas=(0.9, 0.999), eps: float = 1e-8,
          decay_all: bool = True, lr_at: Callable[[int], float] | None = None,
          dtype: torch.dtype = torch.float32, expert_bias_rate: float | None = None,
          muon: set[str] = frozenset()) -> Run:
    """Train ``model`` (modified in place, cast to ``dtype``) on ``steps``: each step a list
    of (inputs, labels) micro-batches of equal size that together make the global batch.
    ``decay_all``: one AdamW group for everything (else matrices and embeddings decay,
    vectors do not). ``max_norm`` 0: no clipping. ``expert_bias_rate``: a mixture of
    experts, balanced as `ExpertBalancing` says. ``muon``: names of the parameters that
    `torch.optim.Muon` (its defaults, this lr and weight decay) updates instead of AdamW."""
    model.to(dtype)
    balancing = ExpertBalancing(model, expert_bias_rate) if expert_bias_rate is not None else None
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for name, p in model.named_parameters() if name in muon]
    adamw = [p for p in params if all(p is not h for h in hidden)]
    groups = [{"params": adamw, "weight_decay": weight_decay}] if decay_all else [
        {"params": [p for p in adamw if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in adamw if p.ndim < 2], "weight_decay": 0.0}]
    optimizers = [torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)]
    if hidden:
        optimizers.append(torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay))
    run = Run()
    for step, micro_batches in enumerate(steps):
        model.zero_grad(set_to_none=True)
        total = 0.0
        if balancing is not None:
            balancing.before_step(sum(labels.numel() for _, labels in micro_batches))
        for inputs, labels in micro_batches:
            logits = logits_of(model(inputs)).flatten(0, 1)
            loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten())
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        for optimizer in optimizers:
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
            optimizer.step()
        if balancing is not None:
            balancing.after_step()
        run.losses.append(total)
        run.grad_norms.append(norm.item())
    run.final = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    run.grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return run


class ExpertBalancing:
    """The training loop's part in a mixture of experts, DeepSeek-V3's recipe written out:
    the balance loss the model adds in backward is the mean over the step's sequences
    (each MoE layer's ``loss_scale`` = 1 / the step's tokens: it sums per-token terms), and
    after each optimizer step every layer's ``expert_bias`` moves by rate * sign(mean load
    - load), the loads counted here from what its router chose during the step."""

    def __init__(self, model: nn.Module, rate: float):
        self.rate = rate
        self.layers = [m for m in model.modules() if hasattr(m, "expert_bias")]
        self.loads = {id(m): torch.zeros(m.expert_bias.numel()) for m in self.layers}
        for m in self.layers:
            m.router.register_forward_hook(self._count(m))

    def _count(self, layer):
        def hook(router, args, output):
            chosen = output[1]  # (weights, chosen experts, scores)
            self.loads[id(layer)] += torch.bincount(chosen.flatten(), minlength=len(self.loads[id(layer)]))
        return hook

    def before_step(self, tokens: int) -> None:
        for m in self.layers:
            m.loss_scale = 1.0 / tokens

    @torch.no_grad()
    def after_step(self) -> None:
        for m in self.layers:
            load = self.loads[id(m)]
            m.expert_bias += self.rate * torch.sign(load.mean() - load).to(m.expert_bias.dtype)
            load.zero_()


@dataclass
class Oracle:
    """The fp32 reference, a second fp32 run that sums in another order (each micro-batch
    split in two and accumulated), the fp64 run, and (optionally) the run without clipping."""
    fp32: Run
    fp32_split: Run
    fp64: Run
    unclipped: Run | None = None

    def noise(self) -> dict:
        """The rounding scale: the largest of the three pairwise distances between the two
        fp32 runs and the fp64 one. Three samples of it, not one, so that a tensor where
        one fp32 run happens to land near exact does not get a tolerance of almost zero."""
        pairs = [(self.fp32, self.fp64), (self.fp32_split, self.fp64), (self.fp32, self.fp32_split)]
        rel = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))
        return {"losses": max(rel(a.losses, b.losses) for a, b in pairs),
                "grad_norms": max(rel(a.grad_norms, b.grad_norms) for a, b in pairs),
                "final": {n: max((a.final[n] - b.final[n]).abs().max().item() for a, b in pairs)
                          for n in self.fp32.final}}


def _split(steps):
    return [[half for x, y in s for half in zip(x.chunk(2), y.chunk(2))] for s in steps]


def run_oracle(make_model: Callable[[], nn.Module], steps, *, with_unclipped: bool = False, **kwargs) -> Oracle:
    """``make_model()`` must return a fresh model with the initial weights each time."""
    fp32 = train(make_model(), steps, **kwargs)
    fp32_split = train(make_model(), _split(steps), **kwargs)
    fp64 = train(make_model(), steps, dtype=torch.float64, **kwargs)
    return Oracle(fp32, fp32_split, fp64, run_unclipped(make_model, steps, **kwargs) if with_unclipped else None)


def run_unclipped(make_model: Callable[[], nn.Module], steps, **kwargs) -> Run:
    """The fp32 reference without clipping (`assert_clipping_binds` measures the difference)."""
    return train(make_model(), steps, **{**kwargs, "max_norm": 0.0})


def deviations(losses, grad_norms, final: dict, oracle: Oracle) -> dict:
    """How far a run is from the fp32 reference, in units of the reference's own rounding
    scale (1.0 = as far as fp32 is from fp64); the check passes while every value <= K."""
    noise, ref = oracle.noise(), oracle.fp32
    scaled = lambda diff, scale, size: diff / (scale + 4 * ULP * size)
    out = {
        "losses": max(scaled(abs(a - b) / abs(b), noise["losses"], 1.0) for a, b in zip(losses, ref.losses)),
        "grad_norms": max(scaled(abs(a - b) / abs(b), noise["grad_norms"], 1.0)
                          for a, b in zip(grad_norms, ref.grad_norms)),
    }
    per_tensor = {name: scaled((final[name] - w).abs().max().item(), noise["final"][name], w.abs().max().item())
                  for name, w in ref.final.items()}
    out["final"] = max(per_tensor.values())
    out["worst_tensor"] = max(per_tensor, key=per_tensor.get)
    return out


def assert_matches(losses, grad_norms, final: dict, oracle: Oracle, label: str) -> dict:
    """Losses, gradient norms and every final weight within K rounding scales of the fp32
    reference (see the module docstring). Returns the deviations, for reports."""
    assert len(losses) == len(oracle.fp32.losses), f"{label}: {len(losses)} steps, the oracle ran {len(oracle.fp32.losses)}"
    assert set(final) == set(oracle.fp32.final), (
        f"{label}: parameters differ: extra {sorted(set(final) - set(oracle.fp32.final))}, "
        f"missing {sorted(set(oracle.fp32.final) - set(final))}")
    dev = deviations(losses, grad_norms, final, oracle)
    for key in ("losses", "grad_norms", "final"):
        where = f" (worst: {dev['worst_tensor']})" if key == "final" else ""
        assert dev[key] <= K, (f"{label}: {key} {dev[key]:.1f} rounding scales from the plain-PyTorch "
                               f"reference{where}, more than the {K} allowed")
    return dev


def assert_clipping_binds(oracle: Oracle, label: str) -> None:
    """Clipping changes the reference's losses by several times the tolerance and its
    weights by far more, so a layout that skipped it could not pass. (AdamW undoes a
    constant gradient scale; only the clip factor's change from step to step shows in the
    losses, so they move less than the weights.)"""
    dev = deviations(oracle.unclipped.losses, oracle.unclipped.grad_norms, oracle.unclipped.final, oracle)
    assert dev["losses"] > 3 * K and dev["final"] > 10 * K, (
        f"{label}: clipping moves the reference only {dev} rounding scales; it must bind harder")


# ---------------------------------------------------------------- a mixture of experts, one token at a time

def moe_forward(x: torch.Tensor, *, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                bias: torch.Tensor, top_k: int, score_func: str, route_norm: bool, route_scale: float,
                shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """A mixture-of-experts feed-forward written as its definition reads, a token and an
    expert at a time: x [b, s, dim] -> (output [b, s, dim], each sequence's balance [b]).

    For each token: scores over the experts (softmax, or a sigmoid each), the top_k of
    scores + bias chosen (the bias only chooses), their scores as weights (divided by their
    sum with route_norm, times route_scale), the output the weighted sum of the chosen
    experts' SwiGLU (w2 [E, dim, h], w1/w3 [E, h, dim]) plus the shared SwiGLU (w1, w2, w3)
    if any. Each sequence's balance is E * sum_e f_e P_e: f_e the share of its k * s choices
    that went to e, P_e the mean over its tokens of e's score divided by the token's score sum."""
    batch, seq, _ = x.shape
    n_experts = gate.shape[0]
    swiglu = lambda v, a, b, c: b @ (F.silu(a @ v) * (c @ v))
    rows, balance = [], []
    for i in range(batch):
        picks, score_share, outs = [0] * n_experts, torch.zeros(n_experts, dtype=x.dtype), []
        for t in range(seq):
            v = x[i, t]
            logits = gate @ v
            scores = torch.softmax(logits.float(), dim=0) if score_func == "softmax" else torch.sigmoid(logits.float())
            chosen = torch.argsort(scores + bias, descending=True)[:top_k].tolist()
            weights = [scores[e] for e in chosen]
            if route_norm:
                total = sum(weights)
                weights = [w / total for w in weights]
            out = sum(w * route_scale * swiglu(v, w1[e], w2[e], w3[e]) for w, e in zip(weights, chosen))
            if shared is not None:
                out = out + swiglu(v, *shared)
            outs.append(out)
            for e in chosen:
                picks[e] += 1
            score_share = score_share + scores / scores.sum()
        rows.append(torch.stack(outs))
        f = torch.tensor(picks, dtype=x.dtype) / (seq * top_k)
        balance.append(n_experts * (f * score_share / seq).sum())
    return torch.stack(rows), torch.stack(balance)
