import math

import pytest
import torch
from torch import nn

from meshtrain.training.optim import build_lr_scheduler, build_optimizer, lr_lambda


def sched(**kw):
    args = dict(warmup_steps=10, total_steps=100, decay_type="cosine", min_lr_ratio=0.1, decay_ratio=0.2)
    args.update(kw)
    return [lr_lambda(s, **args) for s in range(args["total_steps"] + 5)], args


def test_param_groups_split_by_ndim():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    model[0].bias.requires_grad_(False)  # frozen params are left out entirely
    opt = build_optimizer(model, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias)}
    assert decay["betas"] == (0.9, 0.95) and decay["lr"] == 1e-3
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # runs


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd"])
def test_boundaries(decay_type):
    lrs, args = sched(decay_type=decay_type)
    assert lrs[0] == pytest.approx(1 / 10)  # first step never at lr 0
    assert lrs[9] == pytest.approx(1.0)  # last warmup step at the peak
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[99] == pytest.approx(0.1)  # last step at the minimum
    assert all(v == pytest.approx(0.1) for v in lrs[100:])  # and stays there
    assert all(0.0 < v <= 1.0 for v in lrs)


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd", "constant"])
def test_monotonic(decay_type):
    lrs, _ = sched(decay_type=decay_type)
    warmup, rest = lrs[:10], lrs[9:]
    assert all(a < b for a, b in zip(warmup, warmup[1:]))
    assert all(a >= b for a, b in zip(rest, rest[1:]))


def test_cosine_midpoint_and_linear_shape():
    lrs, _ = sched(decay_type="cosine", warmup_steps=0, total_steps=101, min_lr_ratio=0.0)
    assert lrs[0] == pytest.approx(1.0) and lrs[50] == pytest.approx(0.5)
    assert lrs[25] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    lrs, _ = sched(decay_type="linear", warmup_steps=0, total_steps=101, min_lr_ratio=0.0)
    assert lrs[25] == pytest.approx(0.75) and lrs[100] == pytest.approx(0.0)


def test_constant():
    lrs, _ = sched(decay_type="constant")
    assert lrs[0] == pytest.approx(0.1)
    assert all(v == 1.0 for v in lrs[9:])


def test_wsd_flat_then_linear():
    lrs, _ = sched(decay_type="wsd", decay_ratio=0.2)  # decay over the last 20 of 100 steps
    assert all(v == 1.0 for v in lrs[9:81])  # step 80 is the last on the plateau
    decay = lrs[80:100]
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert all(d == pytest.approx(0.9 / 19) for d in steps)  # linear
    assert decay[-1] == pytest.approx(0.1)


def test_no_warmup_and_degenerate_lengths():
    assert lr_lambda(0, warmup_steps=0, total_steps=10, decay_type="cosine", min_lr_ratio=0.0,
                     decay_ratio=0.0) == 1.0
    # one step of training: it is the last step, so it is at the minimum
    assert lr_lambda(0, warmup_steps=0, total_steps=1, decay_type="linear", min_lr_ratio=0.3,
                     decay_ratio=0.0) == pytest.approx(0.3)
    # wsd's decay window never reaches into warmup
    lrs, _ = sched(decay_type="wsd", decay_ratio=1.0)
    assert lrs[0] == pytest.approx(0.1) and lrs[10] == pytest.approx(1.0) and lrs[99] == pytest.approx(0.1)


def test_unknown_decay_type():
    with pytest.raises(ValueError, match="cosine.*linear.*constant.*wsd"):
        lr_lambda(0, warmup_steps=1, total_steps=10, decay_type="step", min_lr_ratio=0.0, decay_ratio=0.0)
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="unknown decay_type"):
        build_lr_scheduler(opt, warmup_steps=1, total_steps=10, decay_type="exp", min_lr_ratio=0.0,
                           decay_ratio=0.0)


def test_scheduler_drives_optimizer_lr():
    model = nn.Linear(2, 2)
    opt = build_optimizer(model, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    sch = build_lr_scheduler(opt, warmup_steps=4, total_steps=20, decay_type="cosine", min_lr_ratio=0.1,
                             decay_ratio=0.0)
    seen = []
    for _ in range(20):
        seen.append([g["lr"] for g in opt.param_groups])  # the lr this optimizer.step() uses
        opt.step()
        sch.step()
    assert seen[0] == pytest.approx([2.5e-4, 2.5e-4])
    assert seen[3] == pytest.approx([1e-3, 1e-3])
    assert seen[19] == pytest.approx([1e-4, 1e-4])
