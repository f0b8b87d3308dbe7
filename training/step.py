"""One optimizer step: forward/backward over the micro-batches, clip, update.

The loss is the mean cross-entropy over every token of the global batch. Each
data-parallel rank averages over its own tokens and divides by the number of
micro-batches; FSDP then averages gradients over the data-parallel ranks. Every rank
sees the same number of tokens, so this equals the single-process mean exactly. Under
context parallelism each cp rank takes its own piece of every sequence (inputs and
labels alike) and FSDP averages over the cp ranks too: the same mean, again.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtrain.parallel import clip_grad_norm_, loss_parallel_context
from meshtrain.parallel.context_parallel import SequenceSplit, split_sequence
from meshtrain.training.faults import step_phase


def _cross_entropy_fp32(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # fp32 for the softmax whatever the compute dtype: bf16 log-sum-exp over 128K
    # classes loses the small probabilities the gradient is made of.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


_loss_impl = _cross_entropy_fp32


def compile_loss(enable: bool = True) -> None:
    """Route `cross_entropy` -- so every train step and pipeline loss -- through
    torch.compile ([compile] loss): eager writes an fp32 copy of the [tokens, vocab]
    logits before the softmax; compiled, the upcast is fused into the softmax kernel.
    Process-wide, like torch.compile's own settings."""
    global _loss_impl
    _loss_impl = torch.compile(_cross_entropy_fp32) if enable else _cross_entropy_fp32


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
    """Mean cross-entropy of the model's ``output`` (see `logits_of`) against ``labels``."""
    return _loss_impl(logits_of(output), labels)


def train_step(model, optimizer, micro_batches, *, max_norm: float = 0.0,
               loss_parallel: bool = False, dp_mesh: DeviceMesh | None = None,
               cp_mesh: DeviceMesh | None = None, device: torch.device | None = None, step: int = 0,
               skip_nonfinite: bool = False) -> tuple[float, float]:
    """Returns (loss averaged over the global batch, global gradient norm before clipping).
    ``model(inputs)`` may return the logits, a dict with "logits" or an object with
    ``.logits`` (a Hugging Face model as it is).
    ``loss_parallel``: the logits are vocab-sharded DTensors (TP with loss_parallel).
    ``cp_mesh``: context parallelism; the micro-batches are whole sequences, each rank
    keeps its piece.
    ``skip_nonfinite``: when the gradient norm is inf/NaN, leave the weights alone (the
    norm is the same on every rank, so every rank skips)."""
    device = device or _device_of(model)  # where the parameters (or their local shards) live
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    split = SequenceSplit(cp_mesh) if cp_mesh is not None else None
    with step_phase(step, "forward/backward"):
        for inputs, labels in micro_batches:
            inputs, labels = split_sequence(inputs, split).to(device), split_sequence(labels, split).to(device)
            with loss_parallel_context(loss_parallel):
                loss = cross_entropy(model(inputs), labels) / len(micro_batches)
                loss.backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    return _finish_step(list(model.parameters()), optimizer, total, max_norm, dp_mesh, None, step,
                        skip_nonfinite, cp_mesh=cp_mesh)


def pipeline_train_step(schedule, model_parts, optimizer, micro_batches, *, first: bool, last: bool,
                        max_norm: float = 0.0, loss_parallel: bool = False,
                        dp_mesh: DeviceMesh | None = None, pp_mesh: DeviceMesh | None = None,
                        cp_mesh: DeviceMesh | None = None, device: torch.device | None = None,
                        step: int = 0, skip_nonfinite: bool = False, tied=None) -> tuple[float, float]:
    """`train_step` for a pipeline: the schedule runs this rank's stages (``model_parts``)
    over each micro-batch, cut again into the schedule's own micro-batches. ``first`` /
    ``last``: this rank holds the first / last stage (feeds tokens / computes the loss).

    The schedule's loss function must divide by every micro-batch of the step (see
    `pipeline_loss_fn`). ``tied``: weights tied across stages (`parallel.tied`), whose
    copies' gradients are summed before clipping. Returns the same values as `train_step`
    on every rank."""
    device = device or _device_of(model_parts[0])
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    split = SequenceSplit(cp_mesh) if cp_mesh is not None else None  # stages pass on seq / cp tokens
    with step_phase(step, "pipeline forward/backward"):
        for inputs, labels in micro_batches:
            args = (split_sequence(inputs, split).to(device),) if first else ()
            target = split_sequence(labels, split).to(device) if last else None
            losses: list[torch.Tensor] = []  # step() empties the list it is given
            with loss_parallel_context(loss_parallel):
                schedule.step(*args, target=target, losses=losses if last else None, return_outputs=False)
            for loss in losses:
                total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    if tied is not None:
        with step_phase(step, "tied-weight gradient sum"):
            tied.sum_gradients()
    params = [p for part in model_parts for p in part.parameters()]
    return _finish_step(params, optimizer, total, max_norm, dp_mesh, pp_mesh, step, skip_nonfinite,
                        not_in_norm=tied.duplicates if tied is not None else (), cp_mesh=cp_mesh)


def _finish_step(params, optimizer, total, max_norm, dp_mesh, pp_mesh, step, skip_nonfinite, not_in_norm=(),
                 cp_mesh=None):
    """Clip, update (unless skipping a non-finite step), and share the loss for reporting."""
    with step_phase(step, "gradient clipping"):
        grad_norm = clip_grad_norm_(params, max_norm, pp_mesh=pp_mesh, not_in_norm=not_in_norm)
    if skip_nonfinite and not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
    else:
        with step_phase(step, "optimizer step"):
            optimizer.step()
    with step_phase(step, "loss reporting"):
        # Reporting only: the gradients were already averaged by FSDP. Under a pipeline the
        # loss exists on the last stage; the sum over pp shares it with every rank.
        if pp_mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        for mesh in (dp_mesh, cp_mesh):  # each rank's mean over its own tokens; all hold as many
            if mesh is not None:
                dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh.get_group())
    return total.item(), grad_norm.item()


def pipeline_loss_fn(micro_batches_per_step: int):
    """Cross-entropy for one schedule micro-batch, scaled so the step's losses (and so
    the gradients) add up to the mean over all of them. The last stage may return the
    logits in any form `logits_of` accepts."""
    def loss_fn(output, labels):
        return cross_entropy(output, labels) / micro_batches_per_step
    return loss_fn


def _device_of(model) -> torch.device:
    param = next(model.parameters())
    return param.to_local().device if isinstance(param, DTensor) else param.device
