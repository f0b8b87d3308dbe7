"""The plain-PyTorch reference (tests/oracle.py) for a `train.py` command line.

From meshtrain it takes only the inputs: the parsed config, the model class with its
initial weights, and the global batch of each step from the data loader (read as one
data-parallel rank of one). The training -- AdamW's groups, the warmup + cosine schedule,
clipping, the loss over the global batch -- is tests/oracle.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests import oracle
from meshtrain.training import recipe
from meshtrain.training.config_loader import parse_args
from meshtrain.training.data import build_dataloader, build_tokenizer


def oracle_for(*argv: str, with_unclipped: bool = False) -> oracle.Oracle:
    """The reference run of ``train.py *argv`` (layout flags do not matter: it is one process)."""
    cfg, _ = parse_args(list(argv))
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    shape = recipe.build_model(cfg, build_tokenizer(t.tokenizer).vocab_size)  # on meta: only its class and config

    def make():
        if cfg.model.name == "hf":
            return plain_transformers_model(shape, t.seed, cfg.checkpoint.initial_load_hf)
        model = type(shape)(shape.cfg)
        model.init_weights(seed=t.seed)
        return model

    data, _ = build_dataloader(t, dp_rank=0, dp_size=1, held_out=cfg.validation.split)
    steps = [data.batch(step) for step in range(t.steps)]
    if s.decay_type == "cosine":
        lr_at = lambda step: oracle.cosine_lr(step, lr=o.lr, warmup=s.warmup_steps, total=t.steps,
                                              min_ratio=s.min_lr_ratio)
    elif s.decay_type == "constant":
        lr_at = lambda step: o.lr * min(1.0, (step + 1) / s.warmup_steps) if s.warmup_steps else o.lr
    else:
        raise NotImplementedError(f"the reference has no {s.decay_type} schedule")
    return oracle.run_oracle(make, steps, with_unclipped=with_unclipped, lr=o.lr, max_norm=t.max_norm,
                             betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, decay_all=False,
                             lr_at=lr_at)


def plain_transformers_model(shape, seed: int, initial_load_hf: str = ""):
    """transformers' own class for a `[model] name = "hf"` model (not meshtrain's subclass),
    on CPU, holding the initial weights meshtrain gives that seed -- or, with
    ``initial_load_hf``, loaded from that folder by transformers' own from_pretrained."""
    import copy

    from meshtrain.models.hf.model import causal_lm_class

    cls = causal_lm_class(shape.cfg.hf)
    if initial_load_hf:
        # Mixtures of experts: transformers' own loop over the experts ("eager"), which runs in
        # fp64 for the reference's fp64 run (its grouped_mm kernel does not). from_pretrained: eval().
        plain = cls.from_pretrained(initial_load_hf, dtype=torch.float32, experts_implementation="eager").train()
        assert type(plain) is cls and type(plain).forward is cls.forward
        return plain
    ours = copy.deepcopy(shape)  # on meta: free
    ours.init_weights(seed=seed, device="cpu")
    plain = cls(cls.config_class.from_dict(shape.cfg.hf))
    assert type(plain) is cls and type(plain).forward is cls.forward
    plain.load_state_dict(ours.state_dict())  # strict: the same names, the same shapes
    return plain


def logged(run_dir: Path, tag: str) -> list[float]:
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The full weights of the run's last checkpoint, by parameter name."""
    from meshtrain.training.checkpoint import complete_checkpoints
    from meshtrain.training.export import model_tensors

    step, path = max(complete_checkpoints(run_dir / "checkpoint"))
    return dict(model_tensors(path))


def assert_run_matches(run_dir: Path, reference: oracle.Oracle, label: str, weights: bool = True) -> dict:
    """A train.py run's logged losses and gradient norms, and (``weights``) its final
    checkpoint, against the reference."""
    final = final_weights(run_dir) if weights else reference.fp32.final
    final = {name: final[name] for name in reference.fp32.final}  # a tied copy is the same tensor
    return oracle.assert_matches(logged(run_dir, "loss"), logged(run_dir, "grad_norm"), final, reference, label)
