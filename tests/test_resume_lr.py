"""Resuming with another [optimizer] lr -- the usual answer to a non-finite stop -- trains
at the config's lr, on the config's schedule, and the console says which lr applies.
Before, the scheduler's saved state won: the run silently kept the old lr."""

from __future__ import annotations

import re

import pytest
from torch import nn

from tests.in_process import tiny_run, train_in_process
from meshtrain.training.optim import Optimizers, Schedulers


def schedule(lr: float, **kw):
    model = nn.Linear(2, 2)
    opt = Optimizers([model], lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    return opt, Schedulers(opt, **{"warmup_steps": 2, "total_steps": 10, "decay_type": "linear",
                                    "min_lr_ratio": 0.0, "decay_ratio": 0.0, **kw})


def test_the_configs_peak_lr_wins_over_the_saved_one():
    _, old = schedule(1e-3)
    for _ in range(6):
        old.step()
    saved = old.state_dict()
    opt, new = schedule(1e-4)
    new.load_state_dict(saved)
    # Step 7 of a linear decay from step 2 to step 9: lr = peak * (1 - (6 - 2) / 7).
    want = 1e-4 * (1 - 4 / 7)
    assert new.get_last_lr()[0] == pytest.approx(want)
    assert [g["lr"] for g in opt.optimizers[0].param_groups] == pytest.approx([want, want])
    new.step()
    assert new.get_last_lr()[0] == pytest.approx(1e-4 * (1 - 5 / 7))


def test_a_resume_at_a_lower_lr_says_so_and_trains_at_it(tmp_path):
    first = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=2", "--optimizer.lr=1e-3"))
    assert first.code == 0, first.stderr[-2000:]
    lower = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=3", "--optimizer.lr=1e-4",
                                       "--checkpoint.if_config_differs=resume"))
    assert lower.code == 0, lower.stderr[-2000:]
    assert ("[optimizer] lr = 0.0001 applies from step 3 (lr 0.0001 there, on this run's schedule); the "
            "checkpoint was trained at peak lr 0.001") in lower.stdout, lower.stdout
    logged = re.search(r"step    3 \|.*lr ([0-9.e+-]+)", lower.stdout)
    assert logged and float(logged.group(1)) == pytest.approx(1e-4), lower.stdout
    same = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=4", "--optimizer.lr=1e-4",
                                      "--checkpoint.if_config_differs=resume"))
    assert same.code == 0 and "applies from step" not in same.stdout  # nothing changed: nothing to say
