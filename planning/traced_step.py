"""One training step of one rank, as train.py builds and runs it, on fake tensors.

`build_rank` builds the rank's model, layout, mesh and parallelized parts with the very
recipe train.py uses (training/recipe.py), on meta; `trace_step` runs forward, loss,
backward, gradient clipping and AdamW. Under a pipeline the schedule itself needs its
neighbours, which a fake group does not have: the rank's forwards and backwards are
replayed in the order torch's schedule runs them (`pipeline_actions`), with FSDP set up as
torch's PipelineStage sets it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed.pipelining  # noqa: F401  its import makes a tensor (a loss reducer's 0.0):
# imported inside a traced step, the tracker counted it
from torch.distributed.tensor import DTensor

from meshtrain.parallel import clip_grad_norm_, hold_gradients, loss_parallel_context, submesh
from meshtrain.parallel.float8 import precompute_float8_scales
from meshtrain.parallel.grad_clip import _whole_group
from meshtrain.parallel.vocabulary import WHOLE_BACKWARD
from meshtrain.planning.alike_microbatches import Copier, copies, keep_gathered
from meshtrain.planning.schedule import Action, rank_actions, replay_prefix
from meshtrain.planning.stages_apart import away_stages, trace_apart, worth_splitting
from meshtrain.training import recipe
from meshtrain.training.step import logits_of, loss_function


def build_rank(cfg, world_size: int, gpus_per_node: int, cut=None):
    """(model, layout, mesh, parts) of this rank, as train.py builds them, on meta.
    ``cut(model, layout)``: the layout the parts are cut with instead (the collective
    check's stages of fewer blocks, planning/alike_blocks.py)."""
    cfg.job.device = "cpu"  # fake tensors live on the CPU; the layout checks are the same
    model = recipe.build_model(cfg, tokenizer_vocab=1)  # vocab from the config (or the byte tokenizer's)
    layout = recipe.plan_layout(cfg, model, world_size, gpus_per_node=gpus_per_node, this_machine=False)
    mesh = layout.build_mesh("cpu")
    # Built uncompiled: the traces run under torch dispatch modes (the memory tracker, the
    # collective recorder), under which dynamo does not compile. The blocks' collectives are
    # FSDP's hooks' and TP's, the same compiled or not (async TP, CUDA only, aside).
    uncompiled = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, enable=False, async_tp=False))
    parts = recipe.build_parts(uncompiled, cut(model, layout) if cut else layout, mesh, model).parts
    for param in (q for _, m in parts for q in m.parameters()):
        if isinstance(param, DTensor):
            _whole_group(param.device_mesh)  # made now: creating groups under fake tensors fails
    return model, layout, mesh, parts


def init_optimizer_state(parts, optimizers, accumulating: bool = False) -> None:
    """AdamW allocates its state on its first step; a steady-state step has it all along,
    so it exists before the traced step (one step on zero gradients, not tracked). With
    gradient accumulation the traced micro-batch is a later one: the sharded gradients of
    the earlier ones are already there (train_step sets them to None only at step start)."""
    for part in parts:
        for q in part.parameters():
            if q.requires_grad:  # a frozen weight (LoRA's base) never has a gradient
                q.grad = torch.zeros_like(q)
    optimizers.step()
    optimizers.zero_grad(set_to_none=not accumulating)


def in_flight(n_micro: int, stage: int, n_stages: int) -> int:
    """For schedules without an F/B action model (the zero-bubble ones): micro-batches
    whose activations one stage holds at once, the 1F1B family's count."""
    return min(n_micro, n_stages - stage)


def rank_seq(cfg, layout) -> int:
    """Tokens of each sequence this rank holds: its piece under context parallelism."""
    return cfg.training.seq_len // layout.cp


def activation_seq(cfg, layout) -> int:
    """Sequence length of the activations between blocks: this rank's piece of the
    sequence (`rank_seq`), divided by tp under sequence parallel."""
    tp, seq = layout.tp, rank_seq(cfg, layout)
    return seq // tp if (tp > 1 and cfg.parallelism.sequence_parallel) else seq


def packed_inputs(cfg, batch: int) -> dict:
    """The model's keyword inputs under [training] document_masking: whole-sequence
    positions (under context parallelism too, as training/step.py passes them), from which
    the model builds its [batch, 1, seq, seq] mask -- what the trace must count. Their
    values do not matter on fake tensors, only their shape."""
    if not cfg.training.document_masking:
        return {}
    return {"positions": torch.zeros(batch, cfg.training.seq_len, dtype=torch.long)}


def step_loss(cfg):
    """The config's cross-entropy, as train.py's step computes it (never compiled here)."""
    return loss_function(chunked=cfg.training.chunked_loss)


def trace_step(cfg, layout, mesh, parts, optimizers, model_cfg, comm, tracker, actions=None,
               copy_alike: bool = True) -> str:
    """One training step of this rank on fake tensors (see the module docstring). Of the
    step's gradient-accumulation micro-batches one is traced: each is the same work and
    frees its activations before the next, so the peak is the same; its collectives are
    counted once per micro-batch. Under a pipeline ``actions`` (default: this rank's
    schedule, up to its last new state) are the forwards and backwards run, micro-batches alike
    an earlier one repeating its record unless not ``copy_alike``. ``comm.phase`` names the
    part of the step running, for reports. Returns what was traced, in words."""
    t = cfg.training
    local, accum = layout.local_batch, layout.grad_accum(t.global_batch_size)
    loss_parallel = layout.tp > 1 and cfg.parallelism.loss_parallel
    if recipe.precomputes_float8_scales(cfg):  # as train.py's step begins (recipe.with_float8_scales)
        comm.scale, comm.phase = (lambda dim, kind: 1), "float8 scales"
        precompute_float8_scales([part for _, part in parts])

    if layout.stage_layers is None:
        model = parts[0][1]
        # Reducing every micro-batch, each is the same work from the same state: one traced,
        # its collectives counted accum times. Reducing once a step (gradient_sync = "step"),
        # the first gathers what the others find gathered and each holds more: the first, one
        # standing for the middle ones, and the last, which reduces (hold_gradients).
        held = layout.reduces_once and accum > 1
        runs = ([("first", 1, True)] + ([("middle", accum - 2, True)] if accum > 2 else []) + [("last", 1, False)]
                if held else [("", accum, False)])
        tokens = torch.randint(0, model_cfg.vocab_size, (local, rank_seq(cfg, layout)))
        for which, times, hold in runs:
            comm.scale = lambda dim, kind, times=times: times
            with loss_parallel_context(loss_parallel):
                comm.phase = f"forward{' of the ' + which + ' micro-batch' if which else ''}"
                loss = step_loss(cfg)(logits_of(model(tokens, **packed_inputs(cfg, local))), tokens)
                comm.phase = f"backward{' of the ' + which + ' micro-batch' if which else ''}"
                if held:
                    hold_gradients(model, hold)
                loss.backward()
            del loss
        traced = (f"the first, {'one of the middle and ' if accum > 2 else ''}the last of {accum} accumulation "
                  f"micro-batches of {local} sequences, reduced once after the last" if held else
                  f"the last of {accum} accumulation micro-batches of {local} sequences (the gradients of "
                  f"the others held)" if accum > 1 else f"one micro-batch of {local} sequences")
    else:
        traced_optimizer = any(not opt.defaults.get("fused") for opt in optimizers.optimizers)
        traced = _trace_pipeline(cfg, layout, parts, model_cfg, comm, tracker, loss_parallel, actions, copy_alike,
                                 apart=not traced_optimizer)
        traced += f"; x {accum} accumulation steps" if accum > 1 else ""
    comm.scale, comm.phase = (lambda dim, kind: 1), "gradient clipping"
    pp_mesh = submesh(mesh, "pp")
    clip_grad_norm_([q for _, part in parts for q in part.parameters()], t.max_norm or 1.0, pp_mesh=pp_mesh)
    comm.phase = "optimizer step"
    with gpu_all_to_all():
        for opt in optimizers.optimizers:
            if not opt.defaults.get("fused"):
                opt.step()
    # A fused AdamW step updates parameters and state in place and allocates nothing once
    # its state exists, so it cannot move the peak. It is not traced: under fake tensors
    # some torch versions (2.11) run its out-of-place form, which would count a whole
    # second copy of parameters, gradients and state (measured on an H100: 64 GiB
    # predicted for a 43 GiB step). Muon's step is: its stacked shards and gathered
    # matrices (training/muon.py) are transient memory of its own, and its all-to-alls
    # are communication.
    return traced


@contextmanager
def gpu_all_to_all():
    """DTensor's Shard -> Shard redistribute as it runs on GPUs: one all-to-all. On a CPU
    mesh DTensor falls back to all-gather + chunk (gloo has no all-to-all), which
    materialises the whole tensor and sends W times the bytes; and the fake kernel of its
    GPU op (_dtensor::shard_dim_alltoall) neither dispatches a collective nor allocates what
    the GPU does. This is the GPU op's own composition (c10d's shard_dim_alltoall: pack the
    pieces along dim 0, all_to_all_single, unpack along the gather dim), so the dry run
    traces its bytes and its buffers (Muon's redistribute, training/muon.py)."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.tensor import placement_types

    def all_to_all(tensor, gather_dim, shard_dim, mesh, mesh_dim):
        w = mesh.size(mesh_dim)
        packed = torch.cat(tensor.chunk(w, dim=shard_dim), dim=0)
        received = funcol.all_to_all_single(packed, None, None, (mesh, mesh_dim))
        received = received.wait() if isinstance(received, funcol.AsyncCollectiveTensor) else received
        return torch.cat(received.chunk(w, dim=0), dim=gather_dim)

    cpu_fallback = placement_types.shard_dim_alltoall
    placement_types.shard_dim_alltoall = all_to_all
    try:
        yield
    finally:
        placement_types.shard_dim_alltoall = cpu_fallback


def pipeline_actions(layout, stage_ids: list[int]) -> list:
    """This rank's forwards and backwards in the order torch's schedule runs them, up to
    the last new state of its step and drained (planning/schedule.py `replay_prefix`). Each
    stage's unsharded gradients grow from its first backward to the step's end, so the
    peak may come late (a replay cut right after every stage's first backward missed 7 of
    45 GiB on Llama 3 8B, pp 2 interleaved). For a schedule without an F/B model, each
    stage's in-flight forwards then their backwards, one stage after another."""
    pp, n_micro = layout.pp, layout.pp_microbatches
    if layout.pp_schedule in WHOLE_BACKWARD and layout.placement == "loop":
        actions = rank_actions(layout.pp_schedule, pp, layout.stages_per_rank, n_micro)[stage_ids[0] % pp]
        return replay_prefix(actions)
    n_stages, out = len(layout.stage_layers), []
    for s in stage_ids:
        k = in_flight(n_micro, s, n_stages)
        out += [Action("F", s, i) for i in range(k)] + [Action("B", s, i) for i in reversed(range(k))]
    return out


def _trace_pipeline(cfg, layout, parts, model_cfg, comm, tracker, loss_parallel, actions=None,
                    copy_alike: bool = True, apart: bool = False) -> str:
    """Replay this rank's forwards and backwards (see `pipeline_actions`). As torch's
    PipelineStage does, FSDP neither reshards nor reduces after a backward until the
    stage's last one, so every local stage's unsharded gradients accumulate meanwhile. A
    micro-batch alike an earlier one is not traced but repeats its record
    (planning/alike_microbatches.py), unless not ``copy_alike``. With ``apart`` (no
    optimizer step traced after the replay), a rank's stages may be traced in two
    processes at once (planning/stages_apart.py)."""
    t, n_micro = cfg.training, layout.pp_microbatches
    accum = layout.grad_accum(t.global_batch_size)
    n_stages, mb, seq = len(layout.stage_layers), layout.micro_batch, activation_seq(cfg, layout)
    dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else torch.float32
    by_stage = dict(parts)
    actions = actions or pipeline_actions(layout, list(by_stage))
    forwards = {s: sum(a.kind == "F" and a.stage == s for a in actions) for s in by_stage}
    pending, loss_fn = {}, step_loss(cfg)
    copied = copies(actions, keep_gathered(parts)) if copy_alike and tracker is not None else {}
    copier, templates = Copier(tracker, comm), set(copied.values())

    def run(a, part) -> None:
        """One action; what it holds on to is in ``pending``, its locals die with it."""
        if a.kind == "F":
            # The tracker refuses a second top-level call of a module it has seen (it
            # takes it for the next step); forgetting the stage's root is enough, and
            # keeps what the pending backwards of other micro-batches look up.
            if tracker is not None:
                tracker.memory_tracking.pop(part, None)
            x = (torch.randint(0, model_cfg.vocab_size, (mb, rank_seq(cfg, layout))) if a.stage == 0 else
                 torch.randn(mb, seq, model_cfg.dim, dtype=dtype, requires_grad=True))
            out = part(x, **packed_inputs(cfg, mb))  # every stage gets them, as in the schedule
            comm.stage_io[a.stage] = ((tuple(x.shape), x.dtype), (tuple(out.shape), out.dtype))
            labels = torch.zeros(mb, rank_seq(cfg, layout), dtype=torch.long)
            pending[a.stage, a.microbatch] = (loss_fn(logits_of(out), labels)
                                              if a.stage == n_stages - 1 else out), x
            return
        out, x = pending.pop((a.stage, a.microbatch))
        hold_gradients(part, hold=True)  # as PipelineStage.backward_one_chunk sets them
        out.backward(None if out.ndim == 0 else torch.ones_like(out))
        # The input's gradient is sent back to the previous stage, then both are dropped.
        # Free the input's storage too: torch's module tracker keeps the tensor itself
        # referenced (its grad hooks), which held 32 MiB per micro-batch of a 70B stage.
        x.grad = None
        if x.dtype.is_floating_point:
            x.untyped_storage().resize_(0)

    def setup(a) -> None:
        # TP collectives (and expert parallelism's all-to-alls) happen per micro-batch,
        # FSDP's per schedule step (once per accumulation step): scale what was traced to
        # the whole step.
        scale = n_micro * accum / forwards[a.stage]
        comm.scale = lambda dim, kind: scale if dim in ("tp", "ep") else accum
        comm.phase = f"{'forward' if a.kind == 'F' else 'backward'} of stage {a.stage}, micro-batch {a.microbatch}"

    def reduce(s, part) -> None:
        # After the step's last backward the schedule reduces each stage's accumulated
        # gradients (its REDUCE_GRAD action): torch's own method, on each traced stage.
        from torch.distributed.pipelining.stage import _PipelineStageBase

        comm.phase = "gradient reduction"
        comm.scale = lambda dim, kind: accum
        _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=part), 1)

    def act(a) -> None:
        with loss_parallel_context(loss_parallel):
            run(a, by_stage[a.stage])

    traced_forwards = {s: sum(a.kind == "F" and a.stage == s and (s, a.microbatch) not in copied for a in actions)
                       for s in by_stage}
    away = away_stages(traced_forwards, layout) if apart and copied and worth_splitting(parts, tracker) else []
    if away:
        trace_apart(actions, copied, parts, away, copier, setup, act, reduce)
    else:
        for a in actions:
            setup(a)
            key = (a.stage, a.microbatch)
            if key in copied:
                copier.copy(a.kind, copied[key], comm.phase)
                continue
            with copier.traced(a.kind, key, keep=key in templates):
                act(a)
        for s, part in parts:
            reduce(s, part)
    held = ", ".join(f"stage {s}: {forwards[s]}" for s in by_stage)
    traced = f"{layout.pp_schedule} order of this rank up to its last new state, drained; forwards ({held}) of {n_micro} micro-batches"
    if copied:
        counts = ", ".join(str(n) for n in traced_forwards.values())
        traced += f", of which {counts} traced, the others repeating an alike one"
    if away:
        traced += f" (stage{'s' if len(away) > 1 else ''} {', '.join(map(str, away))} in a second process at once)"
    return traced
