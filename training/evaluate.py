"""Validation: the loss on held-out data, forward only -- during training and as its own
command, the test loop.

    validation = build_validation(cfg, layout, parts, device)   # None unless [validation] enable
    if validation is not None and validation.due(step, last=step == steps):
        metrics.log(step, validation.run(step))                # {"val/loss": ..., "val/perplexity": ...}

    meshtrain evaluate outputs/debug_2d/checkpoint --config debug_2d --validation.split 0.05 --nproc-per-node 4

The loss is the training loss's definition (training/step.py) over all the first
[validation] steps batches of the validation data (the same batches each time): the
per-token cross-entropies summed over the whole mesh -- every dp and cp rank, every
micro-batch, the pipeline's last stage -- divided by the number of tokens counted
(labels other than -100). Fine-tuning data ("sft") counts its response tokens only, so a
batch of long responses weighs more than one of short ones, as each token does in
training; pretraining data counts every token, and this is the plain mean cross-entropy.
It is one number whatever the layout: a pipeline runs its schedule's forward-only
``eval`` through the same stages, with the same loss function.

Evaluating changes nothing training reads: no gradients (``torch.no_grad``), no optimizer
or scheduler (it is never given them), its own data loader (the training loader's batches
are a function of the step alone), torch's generators restored afterwards (dropout and the
pipeline's shape inference would draw from them), modules back in train mode and FSDP
parameters resharded as a training step leaves them. A run with validation on trains
bitwise like one without, and resumes bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshtrain.parallel import loss_parallel_context, mesh_coordinate, submesh
from meshtrain.parallel.context_parallel import SequenceSplit, split_sequence
from meshtrain.training import recipe
from meshtrain.training.config import ConfigError, JobConfig
from meshtrain.training.data import build_dataloader
from meshtrain.training.faults import step_phase
from meshtrain.training.step import (TokenMeanLoss, global_token_mean, model_kwargs, select_loss,
                                      summed_cross_entropy, token_loss_scale, unpack)


def validation_loader(cfg: JobConfig, *, dp_rank: int, dp_size: int):
    """This rank's loader over the validation data: [validation] dataset, or the part of
    the training data [validation] split holds out (the end of a token stream; for "sft", a
    fixed selection of its records). Batches are cut like training's (same
    global and local batch, seq_len, seed), so the number is the same in every layout.
    Refuses data too small for [validation] steps batches, naming where it came from."""
    v, t = cfg.validation, cfg.training
    if v.dataset:
        source, held_out, part = dataclasses.replace(t, dataset=v.dataset, dataset_path=v.dataset_path), 0.0, "train"
        where = f'[validation] dataset = "{v.dataset}"' + (f', dataset_path = "{v.dataset_path}"' if v.dataset_path else "")
    else:
        source, held_out, part = t, v.split, "held_out"
        path = f' ("{t.dataset_path}")' if t.dataset_path else ""
        where = f'[validation] split = {v.split} of [training] dataset = "{t.dataset}"{path}'
    try:
        data, _ = build_dataloader(source, dp_rank=dp_rank, dp_size=dp_size, held_out=held_out, part=part)
    except ConfigError as err:  # "corpus too small": say which corpus
        raise ConfigError(f"{where}: {err}; it must hold at least one global batch") from None
    needed = v.steps * t.global_batch_size
    if data.num_windows < needed:
        raise ConfigError(f"{where}: [validation] steps = {v.steps} reads {needed} sequences of seq_len + 1 = "
                          f"{t.seq_len + 1} tokens, but the validation data makes only {data.num_windows}; "
                          f"use steps <= {data.num_windows // t.global_batch_size}"
                          + (" or a larger split" if not v.dataset else ""))
    if hasattr(data, "global_sequences"):  # sft: a loss needs at least one response token to score
        # The same global batches on every rank, so every rank refuses alike (no collective).
        if not any(data.global_sequences(k)[1][:, 1:].any() for k in range(v.steps)):
            raise ConfigError(f"{where}: the {v.steps} validation batches hold no response token to score "
                              f"(every response cut off at seq_len + 1 = {t.seq_len + 1} tokens, or none in "
                              f"the records); use a longer seq_len or records with responses")
    return data


class Validation:
    """The validation loss of this rank's parts, over the whole mesh."""

    def __init__(self, cfg: JobConfig, layout, parts: recipe.Parts, device: torch.device):
        mesh, v = parts.mesh, cfg.validation
        dp_rank, dp_size = mesh_coordinate(mesh, "dp")
        self.data = validation_loader(cfg, dp_rank=dp_rank, dp_size=dp_size)
        self.steps, self.interval = v.steps, v.interval
        self.modules, self.device = parts.modules, device
        self.dp_mesh, self.cp_mesh, self.pp_mesh = submesh(mesh, "dp"), submesh(mesh, "cp"), submesh(mesh, "pp")
        self.split = SequenceSplit(self.cp_mesh) if self.cp_mesh is not None else None
        self.loss_parallel = submesh(mesh, "tp") is not None and cfg.parallelism.loss_parallel
        self.schedule, self.first, self.last = None, True, True
        if layout.pipelined:  # the training step's own schedule, run forward-only
            self.schedule = recipe.pipeline_schedule(cfg, layout, parts, device)
            self.first, self.last = recipe.holds_ends(layout, parts)

    def due(self, step: int, last: bool) -> bool:
        return step % self.interval == 0 or last

    def run(self, step: int = 0) -> dict[str, float]:
        """{"val/loss", "val/perplexity"}, the same on every rank."""
        with step_phase(step, "validation"), torch.no_grad(), _untouched(self.modules, self.device):
            # Packed documents carry their positions whole (training/step.py's model_kwargs).
            micro_batches = [(split_sequence(inputs, self.split).to(self.device),
                              split_sequence(labels, self.split).to(self.device), model_kwargs(positions, self.device))
                             for k in range(self.steps) for inputs, labels, positions in map(unpack, self.data.batch(k))]
            # One count for all the batches (every rank takes part: each holds its labels),
            # so the loss is the mean over their tokens, not a mean of per-batch means.
            scale = token_loss_scale([labels for _, labels, _ in micro_batches], self.dp_mesh, self.cp_mesh)
            total = torch.zeros((), device=self.device)
            for inputs, labels, kwargs in micro_batches:
                total += self._summed_loss(inputs, labels, kwargs, scale)
            loss = global_token_mean(total, self.dp_mesh, self.pp_mesh, self.cp_mesh)
        return {"val/loss": loss, "val/perplexity": math.exp(loss) if loss < 700 else math.inf}

    def _summed_loss(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, scale: float) -> torch.Tensor:
        """This rank's summed token losses of one micro-batch times ``scale`` (on a pipeline
        rank without the last stage: 0)."""
        with loss_parallel_context(self.loss_parallel):
            if self.schedule is None:
                losses = [summed_cross_entropy(self.modules[0](inputs, **kwargs), labels) * scale]
            else:  # the training step's loss function, given this evaluation's scale, then its own back
                loss_fn, losses = self.schedule._loss_fn, []
                if not isinstance(loss_fn, TokenMeanLoss):
                    raise TypeError(f"validation needs the pipeline's loss_fn to be a TokenMeanLoss, not {loss_fn!r}")
                kept, loss_fn.scale = loss_fn.scale, scale
                try:
                    self.schedule.eval(*((inputs,) if self.first else ()), target=labels if self.last else None,
                                       losses=losses if self.last else None, return_outputs=False, **kwargs)
                finally:
                    loss_fn.scale = kept
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.full_tensor() if isinstance(loss, DTensor) else loss
        return total


@contextlib.contextmanager
def _untouched(modules, device: torch.device):
    """Eval mode (no dropout) inside; afterwards each module's own mode back, torch's
    generators as they were, and FSDP parameters resharded -- the state a training step
    leaves (a forward without gradients keeps the ones that do not reshard after forward
    gathered)."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        for module in modules:
            module.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            for module in modules:
                for m in module.modules():
                    if isinstance(m, FSDPModule):
                        m.reshard()


def build_validation(cfg: JobConfig, layout, parts: recipe.Parts, device: torch.device) -> Validation | None:
    """The run's validation, or None when [validation] enable is off."""
    return Validation(cfg, layout, parts, device) if cfg.validation.enable else None


# ----------------------------------------------------------------------------- the command

USAGE = """usage: meshtrain evaluate CHECKPOINT --config NAME [--nproc-per-node N] [--out FILE.json] [--section.key VALUE ...]

The validation loss of a saved checkpoint, under any layout: the model of --config (the
run's config), its weights read from CHECKPOINT -- a step folder
(outputs/RUN/checkpoint/step-00000020) or a checkpoint folder (its newest complete step)
-- and the validation data of its [validation] section (the held-out split by default;
enable need not be on). With --nproc-per-node N (or any torchrun option) it runs on N
processes under torchrun, in the [parallelism] layout. Rank 0 prints val/loss and
val/perplexity; --out also writes them, with the step, as JSON."""


def checkpoint_folder(arg: str) -> Path:
    """The step folder CHECKPOINT names: itself, or the newest complete one inside."""
    from meshtrain.training.checkpoint import complete_checkpoints

    path = Path(arg)
    if not path.is_dir():
        raise ConfigError(f"meshtrain evaluate: no checkpoint folder at {arg} "
                          f"({'a file' if path.exists() else 'it does not exist'}); give a step folder such as "
                          "outputs/RUN/checkpoint/step-00000020, or the checkpoint folder holding them")
    if (path / ".metadata").is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise ConfigError(f"meshtrain evaluate: {arg} is neither a checkpoint (no .metadata) nor a folder of "
                          "complete step-N checkpoints")
    return found[-1][1]


def parse_command_line(argv: list[str]) -> tuple[JobConfig, Path, str | None]:
    """(the config, the checkpoint step folder, --out or None), every input checked."""
    from meshtrain.training.config_checks import check_validation
    from meshtrain.training.config_loader import parse_args

    if not argv or argv[0].startswith("-"):
        raise ConfigError("meshtrain evaluate: the first argument is the checkpoint folder (meshtrain evaluate --help)")
    rest, out = list(argv[1:]), None
    for i, token in enumerate(rest):
        flag, eq, value = token.partition("=")
        if flag == "--out":
            if not eq:
                if i + 1 == len(rest):
                    raise ConfigError("meshtrain evaluate: --out needs a file name")
                value = rest.pop(i + 1)
            out = value
            rest.pop(i)
            break
    cfg, args = parse_args(rest)
    if args.dry_run or args.print_config:
        raise ConfigError("meshtrain evaluate: --dry-run and --print-config belong to meshtrain train")
    check_validation(cfg, needed_by="meshtrain evaluate")
    return cfg, checkpoint_folder(argv[0]), out


def evaluate_checkpoint(cfg: JobConfig, path: Path) -> tuple[int, dict[str, float]]:
    """(the checkpoint's step, its validation scalars): the model built and laid out as
    train.py builds it, the checkpoint's weights loaded, one evaluation."""
    from meshtrain.parallel import shutdown_distributed
    from meshtrain.training.checkpoint import load_model
    from meshtrain.training.data import build_tokenizer

    t = cfg.training
    torch.manual_seed(t.seed)
    model = recipe.build_model(cfg, build_tokenizer(t.tokenizer).vocab_size)
    layout = recipe.plan_layout(cfg, model)
    mesh = layout.build_mesh(recipe.device_type(cfg), timeout_seconds=cfg.comm.init_timeout_seconds)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    parts = recipe.build_parts(cfg, layout, mesh, model)
    select_loss(chunked=t.chunked_loss, compiled=cfg.compile.loss)  # the loss training computes
    for part in parts.modules:
        part.init_weights(seed=t.seed, device=device)  # allocates this rank's shards; the checkpoint fills them
    try:
        step = load_model(path, parts.modules, model.cfg)
        scalars = Validation(cfg, layout, parts, device).run(step)
    finally:
        shutdown_distributed()
    return step, scalars


def main(argv: list[str]) -> None:
    """`meshtrain evaluate` in this process (cli.py launches torchrun and says errors once)."""
    cfg, path, out = parse_command_line(argv)
    step, scalars = evaluate_checkpoint(cfg, path)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"meshtrain: evaluate: {path} (step {step}): val/loss {scalars['val/loss']:.6f} | "
              f"val/perplexity {scalars['val/perplexity']:.3f}", flush=True)
        if out:
            Path(out).write_text(json.dumps({"checkpoint": str(path), "step": step, **scalars}, indent=1) + "\n")
