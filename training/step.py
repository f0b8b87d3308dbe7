"""One optimizer step: forward/backward over the micro-batches, clip, update.

The loss is the mean cross-entropy over the counted tokens of the whole global batch:
every label except IGNORE_INDEX (-100, the prompt and padding of a fine-tuning
sequence, and the EOS of a pretraining window with document masking; otherwise every
token counts). One number, whatever the layout, the micro-batching or the gradient
accumulation:

    loss = sum of per-token losses over the global batch / tokens counted in it

A mean per micro-batch, divided by the number of micro-batches (what this file did
before, and transformers' Trainer until 2024), is that only when every micro-batch
counts as many tokens: with -100 labels a micro-batch of short responses would weigh as
much as one of long ones. So, before any backward, each rank counts its labels and the
count is summed over the data-parallel (and context-parallel) ranks -- one scalar
all-reduce. Each micro-batch then backpropagates its summed token losses divided by that
global count. FSDP averages gradients over the dp x cp ranks it shards over (it divides
their sum by dp * cp), so each rank multiplies its loss by dp * cp first: the sum of the
ranks' gradients is what reaches the weights, i.e. the gradient of the global mean.
Under context parallelism each cp rank takes its own piece of every sequence (inputs and
labels alike) and counts the labels of its piece.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtrain.parallel import clip_grad_norm_, hold_gradients, loss_parallel_context
from meshtrain.parallel.context_parallel import SequenceSplit, split_sequence
from meshtrain.training.chunked_loss import IGNORE_INDEX, chunked_cross_entropy  # IGNORE_INDEX: -100
from meshtrain.training.faults import step_phase
from meshtrain.training.hang_report import where


def _cross_entropy_fp32(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    # fp32 for the softmax whatever the compute dtype: bf16 log-sum-exp over 128K
    # classes loses the small probabilities the gradient is made of.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction=reduction,
                           ignore_index=IGNORE_INDEX)


_loss_impl = _cross_entropy_fp32


def loss_function(chunked: bool = False, compiled: bool = False):
    """The cross-entropy (logits, labels, reduction="mean") of a config: F.cross_entropy on
    the fp32 upcast of the logits (the default); the same through torch.compile ([compile]
    loss: eager writes an fp32 copy of the [tokens, vocab] logits before the softmax,
    compiled the upcast is fused into the softmax kernel); or `chunked_cross_entropy`
    ([training] chunked_loss: no fp32 copy of the whole logits, training/chunked_loss.py)."""
    if chunked and compiled:
        raise ValueError("choose chunked or compiled, not both")
    return (chunked_cross_entropy if chunked else
            torch.compile(_cross_entropy_fp32) if compiled else _cross_entropy_fp32)


def select_loss(chunked: bool = False, compiled: bool = False) -> None:
    """Route every train step's, pipeline loss's and evaluation's cross-entropy through
    `loss_function`'s choice. Process-wide, like torch.compile's own settings."""
    global _loss_impl
    _loss_impl = loss_function(chunked, compiled)


def logits_of(output) -> torch.Tensor:
    """The logits in what a model's forward returned: the tensor itself, a dict with
    "logits", or an object with ``.logits`` (a Hugging Face ``CausalLMOutput``, which is
    both). So a model is trained as it is, with no wrapper that unpacks its output."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the model returned a {type(output).__name__}; the loss needs the logits: "
                    "a tensor, a dict with 'logits', or an object with a .logits tensor")


def cross_entropy(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model's ``output`` (see `logits_of`) against ``labels``,
    over the labels that are not IGNORE_INDEX."""
    return _loss_impl(logits_of(output), labels)


def summed_cross_entropy(output, labels: torch.Tensor) -> torch.Tensor:
    """The per-token cross-entropies of ``output`` against ``labels``, summed (IGNORE_INDEX
    labels add nothing); a step divides by the global count (`token_loss_scale`)."""
    return _loss_impl(logits_of(output), labels, "sum")


def unpack(micro_batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, labels, positions or None) of a micro-batch: (inputs, labels), or with
    packed documents (training/sft_files.py, document_masking) (inputs, labels, positions)."""
    inputs, labels, *rest = micro_batch
    return inputs, labels, rest[0] if rest else None


def model_kwargs(positions: torch.Tensor | None, device) -> dict:
    """The model's keyword inputs for a micro-batch: ``positions`` of the *whole* sequence
    (not split under context parallelism: attention runs over the whole sequence, see
    parallel/context_parallel.py), or none at all -- a model without packed documents is
    called exactly as before."""
    return {} if positions is None else {"positions": positions.to(device)}


def token_loss_scale(labels: list[torch.Tensor], dp_mesh: DeviceMesh | None = None,
                     cp_mesh: DeviceMesh | None = None) -> float:
    """The factor that turns one micro-batch's summed token losses into its part of the
    loss to backpropagate: (dp * cp ranks FSDP averages over) / (tokens counted in the whole
    global batch). ``labels``: this rank's labels for the step (its cp piece under context
    parallelism). The count is one all-reduced scalar, read once per step. A global batch
    that counts no token at all (every label -100) gives a loss and gradients of zero."""
    count = sum((y != IGNORE_INDEX).sum() for y in labels) if labels else torch.zeros((), dtype=torch.int64)
    ranks = 1
    for mesh in (dp_mesh, cp_mesh):
        if mesh is not None:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=mesh.get_group())
            ranks *= mesh.size()
    return ranks / max(int(count.item()), 1)


def train_step(model, optimizer, micro_batches, *, max_norm: float = 0.0,
               loss_parallel: bool = False, dp_mesh: DeviceMesh | None = None,
               cp_mesh: DeviceMesh | None = None, device: torch.device | None = None, step: int = 0,
               skip_nonfinite: bool = False, gradient_sync: str = "microbatch") -> tuple[float, float]:
    """Returns (loss averaged over the global batch, global gradient norm before clipping).
    A micro-batch is (inputs, labels) or (inputs, labels, positions) (packed documents:
    then ``model(inputs, positions=positions)``, see `model_kwargs`).
    ``model(inputs)`` may return the logits, a dict with "logits" or an object with
    ``.logits`` (a Hugging Face model as it is).
    ``loss_parallel``: the logits are vocab-sharded DTensors (TP with loss_parallel).
    ``cp_mesh``: context parallelism; the micro-batches are whole sequences, each rank
    keeps its piece.
    ``skip_nonfinite``: when the gradient norm is inf/NaN, leave the weights alone (the
    norm is the same on every rank, so every rank skips). ``gradient_sync``: "microbatch",
    FSDP reduces after every micro-batch's backward; "step", only after the last, the others
    holding their unsharded gradient sums (`hold_gradients`)."""
    device = device or _device_of(model)  # where the parameters (or their local shards) live
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    split = SequenceSplit(cp_mesh) if cp_mesh is not None else None
    batches = [(split_sequence(inputs, split).to(device), split_sequence(labels, split).to(device),
                model_kwargs(positions, device))
               for inputs, labels, positions in map(unpack, micro_batches)]
    with step_phase(step, "token count"):
        scale = token_loss_scale([labels for _, labels, _ in batches], dp_mesh, cp_mesh)
    call_hook([model], "set_loss_scale", scale)
    with step_phase(step, "forward/backward"):
        for i, (inputs, labels, kwargs) in enumerate(batches):
            where.micro_batch = i  # for the hang report
            with loss_parallel_context(loss_parallel):
                loss = summed_cross_entropy(model(inputs, **kwargs), labels) * scale
                if gradient_sync == "step":  # reduce once, after the last micro-batch's backward
                    hold_gradients(model, hold=i < len(batches) - 1)
                loss.backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    return _finish_step([model], optimizer, total, max_norm, dp_mesh, None, step, skip_nonfinite, cp_mesh=cp_mesh)


def pipeline_train_step(schedule, model_parts, optimizer, micro_batches, *, first: bool, last: bool,
                        max_norm: float = 0.0, loss_parallel: bool = False,
                        dp_mesh: DeviceMesh | None = None, pp_mesh: DeviceMesh | None = None,
                        cp_mesh: DeviceMesh | None = None, device: torch.device | None = None,
                        step: int = 0, skip_nonfinite: bool = False, tied=None) -> tuple[float, float]:
    """`train_step` for a pipeline: the schedule runs this rank's stages (``model_parts``)
    over each micro-batch, cut again into the schedule's own micro-batches. ``first`` /
    ``last``: this rank holds the first / last stage (feeds tokens / computes the loss).

    The schedule's loss function is `pipeline_loss_fn`'s: this function gives it the
    step's global token count before the schedule runs. (Another loss function is used as
    it is, and must itself be scaled for the whole step.) ``tied``: weights tied across
    stages (`parallel.tied`), whose copies' gradients are summed before clipping. Returns
    the same values as `train_step` on every rank."""
    device = device or _device_of(model_parts[0])
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    split = SequenceSplit(cp_mesh) if cp_mesh is not None else None  # stages pass on seq / cp tokens
    loss_fn = getattr(schedule, "_loss_fn", None)  # torch keeps the schedule's loss_fn there
    if isinstance(loss_fn, TokenMeanLoss):
        # Every stage holds the labels (the loader gives each rank its batch), so every rank
        # takes part in the count's all-reduce over dp and cp; only the last stage uses it.
        with step_phase(step, "token count"):
            labels = [split_sequence(unpack(b)[1], split).to(device) for b in micro_batches]  # NCCL: on device
            loss_fn.scale = token_loss_scale(labels, dp_mesh, cp_mesh)
        call_hook(model_parts, "set_loss_scale", loss_fn.scale)
    with step_phase(step, "pipeline forward/backward"):
        for i, (inputs, labels, positions) in enumerate(map(unpack, micro_batches)):
            where.micro_batch = i  # for the hang report
            args = (split_sequence(inputs, split).to(device),) if first else ()
            target = split_sequence(labels, split).to(device) if last else None
            losses: list[torch.Tensor] = []  # step() empties the list it is given
            with loss_parallel_context(loss_parallel):
                # Keyword inputs go to every stage, cut into the schedule's micro-batches
                # along the batch dimension as the tokens are (torch's schedules.py).
                schedule.step(*args, target=target, losses=losses if last else None, return_outputs=False,
                              **model_kwargs(positions, device))
            for loss in losses:
                total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    if tied is not None:
        with step_phase(step, "tied-weight gradient sum"):
            tied.sum_gradients()
    return _finish_step(model_parts, optimizer, total, max_norm, dp_mesh, pp_mesh, step, skip_nonfinite,
                        not_in_norm=tied.duplicates if tied is not None else (), cp_mesh=cp_mesh)


def _finish_step(parts, optimizer, total, max_norm, dp_mesh, pp_mesh, step, skip_nonfinite, not_in_norm=(),
                 cp_mesh=None):
    """Clip, update (unless skipping a non-finite step), let the model update what is not a
    parameter, and share the loss for reporting."""
    params = [p for part in parts for p in part.parameters()]
    with step_phase(step, "gradient clipping"):
        grad_norm = clip_grad_norm_(params, max_norm, pp_mesh=pp_mesh, not_in_norm=not_in_norm)
    skip = skip_nonfinite and not torch.isfinite(grad_norm)
    if skip:
        optimizer.zero_grad(set_to_none=True)
    with step_phase(step, "optimizer step"):
        if not skip:
            optimizer.step()
        # Also after a skipped step: what the model observed (expert loads) was real.
        call_hook(parts, "after_optimizer_step", sum_over=(dp_mesh, cp_mesh))
    with step_phase(step, "loss reporting"):  # reporting only: FSDP already averaged the gradients
        loss = global_token_mean(total, dp_mesh, pp_mesh, cp_mesh)
    return loss, grad_norm.item()


def call_hook(parts, name: str, *args, **kwargs) -> None:
    """``part.name(*args, **kwargs)`` on each model part that defines it: the optional calls
    of the model contract (models/registry.py), e.g. a mixture of experts' balance-loss
    scale and routing-bias update. A model without them is trained exactly as before."""
    for part in parts:
        hook = getattr(part, name, None)
        if callable(hook):
            hook(*args, **kwargs)


def global_token_mean(total: torch.Tensor, dp_mesh: DeviceMesh | None = None, pp_mesh: DeviceMesh | None = None,
                      cp_mesh: DeviceMesh | None = None) -> float:
    """The mean over the whole mesh's counted tokens, the same on every rank, from this
    rank's ``total``: its summed token losses times `token_loss_scale` (on a pipeline rank
    without the last stage: 0). Under a pipeline the losses exist on the last stage; the
    sum over pp shares them with every rank. Each rank's total is dp * cp times its share:
    the average over dp and cp is the sum of the shares. ``total`` is reduced in place."""
    if pp_mesh is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    for mesh in (dp_mesh, cp_mesh):
        if mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh.get_group())
    return total.item()


class TokenMeanLoss:
    """A pipeline schedule's loss_fn: one schedule micro-batch's summed token losses times
    ``scale``, which `pipeline_train_step` sets each step from the global token count
    (`token_loss_scale`), so the step's losses and gradients add up to the mean over the
    global batch's counted tokens, as in `train_step`. Until a step sets it (called on its
    own), it is the micro-batch's mean divided by ``micro_batches_per_step``. The last
    stage may return the logits in any form `logits_of` accepts."""

    def __init__(self, micro_batches_per_step: int):
        self.micro_batches_per_step = micro_batches_per_step
        self.scale: float | None = None

    def __call__(self, output, labels):
        if self.scale is None:
            return cross_entropy(output, labels) / self.micro_batches_per_step
        return summed_cross_entropy(output, labels) * self.scale


def pipeline_loss_fn(micro_batches_per_step: int) -> TokenMeanLoss:
    """The loss_fn for `build_schedule`: see `TokenMeanLoss`. ``micro_batches_per_step``
    (schedule micro-batches x gradient accumulation) only matters outside `pipeline_train_step`."""
    return TokenMeanLoss(micro_batches_per_step)


def _device_of(model) -> torch.device:
    param = next(model.parameters())
    return param.to_local().device if isinstance(param, DTensor) else param.device
