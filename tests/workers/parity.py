"""Train the debug Llama (or GPT-2) a few steps under one parallel layout and record losses, gradient
norms and full weights (at init and at the end). Run with no process group for the
single-process reference, or under torchrun for a layout:

    torchrun --nproc-per-node 4 tests/workers/parity.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.models import registry
from meshtrain.models.gpt2 import GPT2
from meshtrain.models.llama import Llama
from meshtrain.models.moe import MoETransformer
from meshtrain.models.moe.experts import GroupedExperts
from meshtrain.parallel import ParallelDims, parallelize, shutdown_distributed, submesh
from meshtrain.training.optim import Optimizers, Schedulers
from meshtrain.training import chunked_loss, step as training_step
from meshtrain.training.step import train_step

STEPS, BATCH, SEQ, LR, MAX_NORM = 8, 8, 32, 1e-3, 0.1
BETAS, WEIGHT_DECAY, WARMUP, MIN_LR_RATIO = (0.9, 0.95), 0.1, 2, 0.1

# Muon's layouts train the debug model at half its width (dim 64, the same layers and heads):
# torch.optim.Muon's Newton-Schulz runs in bf16, which a CPU without bf16 matmul instructions
# runs ~50x slower than fp32 -- 8x less of it here, in every rank and in the reference.
MUON = dict(optimizer="Muon", dim=64, ffn_hidden=128)  # GPT-2 below: its FFN is 4 x dim

# name -> (ParallelDims kwargs, sharding strategy, model overrides; family="gpt2" picks GPT-2)
LAYOUTS = {
    "fsdp4": (dict(dp_shard=4), "FULL_SHARD", {}),
    "tp4": (dict(tp=4, dp_shard=1), "FULL_SHARD", {}),
    "dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", {}),
    "hsdp2x2": (dict(dp_replicate=2, dp_shard=2), "HYBRID_SHARD", {}),
    "hsdp_zero2_2x2": (dict(dp_replicate=2, dp_shard=2), "HYBRID_SHARD_ZERO2", {}),
    "shard_grad_op4": (dict(dp_shard=4), "SHARD_GRAD_OP", {}),
    "no_shard4": (dict(dp_shard=4), "NO_SHARD", {}),
    "no_shard2_tp2": (dict(dp_shard=2, tp=2), "NO_SHARD", {}),
    # GQA with one kv head per TP rank shared by 4 query heads.
    "gqa_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(n_kv_heads=2)),
    "tp2_no_sp": (dict(dp_shard=2, tp=2), "FULL_SHARD", {}),
    # A vocab of 250 does not split evenly over 4 FSDP ranks (63, 63, 63, 61 rows).
    "uneven_fsdp4": (dict(dp_shard=4), "FULL_SHARD", dict(vocab_size=250)),
    "uneven_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(vocab_size=250)),
    # Tied embedding/output weights must stay one weight under TP and FSDP.
    "tied_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(tie_embeddings=True)),
    "gpt2_fsdp4": (dict(dp_shard=4), "FULL_SHARD", dict(family="gpt2")),
    "gpt2_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(family="gpt2")),
    "gpt2_tp4": (dict(tp=4, dp_shard=1), "FULL_SHARD", dict(family="gpt2")),
    # A mixture of experts (softmax scores, shared expert, dense first block, the balance
    # loss and the loss-free bias on): experts replicated over tp, loads summed over dp.
    "moe_fsdp4": (dict(dp_shard=4), "FULL_SHARD", dict(family="moe")),
    "moe_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(family="moe")),
    "moe_sigmoid_fsdp4": (dict(dp_shard=4), "FULL_SHARD", dict(family="moe", score_func="sigmoid", route_scale=2.5)),
    # [optimizer] name = "Muon": each hidden matrix whole on one rank of its shard group.
    "muon_fsdp4": (dict(dp_shard=4), "FULL_SHARD", MUON),
    "muon_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", MUON),
    "muon_hsdp2x2": (dict(dp_replicate=2, dp_shard=2), "HYBRID_SHARD", MUON),
    "muon_gpt2_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(family="gpt2", optimizer="Muon", dim=64)),
    # Expert parallelism: experts split over ep ranks borrowed from dp_shard, tokens sent to
    # them and back by all-to-all; the experts' FSDP shards over dp_shard / ep (2, then 1).
    "moe_ep2_fsdp4": (dict(dp_shard=4, ep=2), "FULL_SHARD", dict(family="moe")),
    "moe_ep4_fsdp4": (dict(dp_shard=4, ep=4), "FULL_SHARD", dict(family="moe")),
    # ep x tp: each tp rank routes the same tokens and exchanges them within its own ep group.
    "moe_ep2_dp2_tp2": (dict(dp_shard=2, tp=2, ep=2), "FULL_SHARD", dict(family="moe")),
    # Half the steps under ep 2, a DCP checkpoint, the rest resumed from it under ep 4: the
    # experts resharded (4 per rank, then 2) and the run as if never stopped.
    "moe_ep2_resumed_ep4": (dict(dp_shard=4, ep=2, resume_ep=4), "FULL_SHARD", dict(family="moe")),
    # Every block recomputed in backward: the recomputation sends its tokens through the
    # all-to-alls again, and backward must run through exactly what the forward computed.
    "moe_ep2_fsdp4_ac_full": (dict(dp_shard=4, ep=2, ac="full"), "FULL_SHARD", dict(family="moe")),
    # [training] chunked_loss (its value here: fp32 elements a chunk, so each rank's 64 or
    # 128 tokens go in several chunks), and on vocab-sharded logits (loss_parallel: 125 words a rank).
    "chunked_loss_dp2_tp2": (dict(dp_shard=2, tp=2), "FULL_SHARD", dict(vocab_size=250, chunked_loss=250 * 11)),
    "chunked_loss_fsdp4": (dict(dp_shard=4), "FULL_SHARD", dict(chunked_loss=256 * 11)),
    # Gradient accumulation, two micro-batches a step: reduced after each ([parallelism]
    # gradient_sync = "microbatch"), or once after the last ("step": each unit's unsharded
    # fp32 gradient sum and gathered weights held between them).
    "fsdp4_accum2": (dict(dp_shard=4, accum=2), "FULL_SHARD", {}),
    "fsdp4_accum2_sync_step": (dict(dp_shard=4, accum=2, sync="step"), "FULL_SHARD", {}),
    "shard_grad_op4_accum2": (dict(dp_shard=4, accum=2), "SHARD_GRAD_OP", {}),
    "shard_grad_op4_accum2_sync_step": (dict(dp_shard=4, accum=2, sync="step"), "SHARD_GRAD_OP", {}),
    "hsdp2x2_accum2_sync_step": (dict(dp_replicate=2, dp_shard=2, accum=2, sync="step"), "HYBRID_SHARD", {}),
    "no_shard2_tp2_accum2_sync_step": (dict(dp_shard=2, tp=2, accum=2, sync="step"), "NO_SHARD", {}),
    # [compile] enable under TP: the blocks compiled (inductor), the first one's input a view
    # from the embedding's DTensor; and with every block recomputed, TP's collectives again.
    "compiled_dp2_tp2": (dict(dp_shard=2, tp=2, compile=True), "FULL_SHARD", {}),
    "compiled_dp2_tp2_ac_full": (dict(dp_shard=2, tp=2, compile=True, ac="full"), "FULL_SHARD", {}),
}
NO_SEQUENCE_PARALLEL = {"tp2_no_sp"}

# Pipeline layouts: name -> (ParallelDims kwargs, schedule, options). Options: strategy
# (default "auto" = SHARD_GRAD_OP under PP), stages per rank, micro-batches, split points,
# accumulation (batches per step through the schedule), model (overrides as above).
PP_LAYOUTS = {
    "pp2_1f1b": (dict(pp=2, dp_shard=1), "1F1B", dict(micro=4)),
    "pp2_gpipe": (dict(pp=2, dp_shard=1), "GPipe", dict(micro=2)),
    "pp2_uneven_accum": (dict(pp=2, dp_shard=1), "1F1B", dict(micro=2, split=[1], accum=2)),
    "pp2_interleaved": (dict(pp=2, dp_shard=1), "Interleaved1F1B", dict(per_rank=2, micro=4)),
    "pp2_looped_bfs": (dict(pp=2, dp_shard=1), "LoopedBFS", dict(per_rank=2, micro=2)),
    "pp2_zero_bubble": (dict(pp=2, dp_shard=1), "InterleavedZeroBubble", dict(per_rank=2, micro=4)),
    "pp2_zbv": (dict(pp=2, dp_shard=1), "ZBVZeroBubble", dict(per_rank=2, micro=4)),
    "pp2_dualpipev": (dict(pp=2, dp_shard=1), "DualPipeV", dict(per_rank=2, micro=4)),
    "pp2_dp2": (dict(pp=2, dp_shard=2), "1F1B", dict(micro=2)),
    "pp2_dp2_full_shard": (dict(pp=2, dp_shard=2), "1F1B", dict(micro=4, strategy="FULL_SHARD")),
    "pp2_tp2": (dict(pp=2, tp=2, dp_shard=1), "1F1B", dict(micro=2)),
    "pp2_dp2_tp2": (dict(pp=2, dp_shard=2, tp=2), "1F1B", dict(micro=2)),
    # Tied weights split over the first and last stage: on two ranks (looped), or on one
    # (V-shaped: the first and last stage share rank 0).
    "tied_pp2": (dict(pp=2, dp_shard=1), "1F1B", dict(micro=2, model=dict(tie_embeddings=True))),
    "gpt2_pp2_dp2": (dict(pp=2, dp_shard=2), "1F1B", dict(micro=2, model=dict(family="gpt2"))),
    "gpt2_pp2_tp2": (dict(pp=2, tp=2, dp_shard=1), "1F1B", dict(micro=2, model=dict(family="gpt2"))),
    "moe_pp2_dp2": (dict(pp=2, dp_shard=2), "1F1B", dict(micro=2, model=dict(family="moe"))),
    "moe_pp2_tp2": (dict(pp=2, tp=2, dp_shard=1), "1F1B", dict(micro=2, model=dict(family="moe"))),
    "moe_pp2_ep2": (dict(pp=2, dp_shard=2, ep=2), "1F1B", dict(micro=2, model=dict(family="moe"))),
    "gpt2_pp2_zbv": (dict(pp=2, dp_shard=1), "ZBVZeroBubble", dict(per_rank=2, micro=4,
                                                                    model=dict(family="gpt2"))),
    "muon_pp2_dp2": (dict(pp=2, dp_shard=2), "1F1B", dict(micro=2, model=MUON)),
    "muon_pp2_dp2_tp2": (dict(pp=2, dp_shard=2, tp=2), "1F1B", dict(micro=2, model=MUON)),
    "chunked_loss_pp2_tp2": (dict(pp=2, tp=2, dp_shard=1), "1F1B", dict(micro=2, model=dict(chunked_loss=256 * 11))),
}


def build(overrides: dict, meta: bool = True):
    """The debug model (on meta unless ``meta=False``): GPT-2 or the mixture of experts when
    overrides say family="gpt2" or "moe", else Llama (``optimizer`` is not the model's)."""
    overrides = dict(overrides)
    overrides.pop("optimizer", None)
    overrides.pop("chunked_loss", None)
    family = {"llama": Llama, "gpt2": GPT2, "moe": MoETransformer}[overrides.pop("family", "llama")]
    return family.from_flavor("debug", meta=meta, **overrides)


def batches(vocab_size: int) -> torch.Tensor:
    """Learnable token streams (arithmetic progressions mod vocab), fixed by a seed."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, vocab_size, (STEPS, BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (STEPS, BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % vocab_size


def optimizer_and_schedule(parts, overrides: dict | None = None):
    """What train.py builds: AdamW per part (decay on matrices and embeddings only) -- or
    with overrides' optimizer="Muon", Muon (torch's defaults) for the hidden matrices and
    AdamW for the rest -- warmup then cosine decay. The schedule moves the learning rate
    every step of these short runs."""
    overrides = overrides or {}
    output_layer = registry.get(overrides.get("family", "llama")).output_layer
    optimizer = Optimizers(parts, name=overrides.get("optimizer", "AdamW"), output_layer=output_layer, lr=LR,
                           beta1=BETAS[0], beta2=BETAS[1], eps=1e-8, weight_decay=WEIGHT_DECAY)
    return optimizer, Schedulers(optimizer, warmup_steps=WARMUP, total_steps=STEPS, decay_type="cosine",
                                 min_lr_ratio=MIN_LR_RATIO, decay_ratio=0.0)


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every weight whole, by its name without activation checkpointing's wrapper prefix."""
    from meshtrain.parallel.init import canonical_name

    return {canonical_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def run_pipeline(layout: str) -> dict:
    from meshtrain.parallel.pipeline import SCHEDULES, build_schedule, check_pipeline, split_into_stages
    from meshtrain.parallel.tied import tie_across_stages
    from meshtrain.training.step import pipeline_loss_fn, pipeline_train_step

    dims, schedule_name, opts = PP_LAYOUTS[layout]
    micro, accum = opts["micro"], opts.get("accum", 1)
    mesh = ParallelDims(**dims).build_mesh()
    pp_mesh, dp_mesh, tp_mesh = submesh(mesh, "pp"), submesh(mesh, "dp"), submesh(mesh, "tp")
    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    per_rank = BATCH // dp_size
    model = build(opts.get("model", {}))
    layers = check_pipeline(pp=pp_mesh.size(), n_layers=model.cfg.n_layers, schedule=schedule_name,
                            stages_per_rank=opts.get("per_rank", 1), n_microbatches=micro,
                            local_batch=per_rank // accum, split_points=opts.get("split", ()))
    parts = split_into_stages(model, pp_mesh, layers, style=SCHEDULES[schedule_name][1])
    for _, part in parts:
        parallelize(part, mesh, sharding_strategy=opts.get("strategy", "auto"), ep=dims.get("ep", 1))
        part.init_weights(seed=0)
    modules = [part for _, part in parts]
    ids = [i for i, _ in parts]
    tied = tie_across_stages(modules, mesh, pp_mesh, model.tied_weights())
    schedule = build_schedule(schedule_name, parts, pp_mesh, n_microbatches=micro, n_stages=len(layers),
                              loss_fn=pipeline_loss_fn(micro * accum), device=torch.device("cpu"))
    result = {"init": gather_stages(modules, pp_mesh), "losses": [], "grad_norms": [], "layers": layers,
              "tied": model.tied_weights()}
    optimizer, scheduler = optimizer_and_schedule(modules, opts.get("model", {}))
    for tokens in batches(model.cfg.vocab_size):
        local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        steps = [(c[:, :-1], c[:, 1:]) for c in local.chunk(accum)]
        loss, norm = pipeline_train_step(schedule, modules, optimizer, steps, first=0 in ids,
                                         last=len(layers) - 1 in ids, max_norm=MAX_NORM,
                                         loss_parallel=tp_mesh is not None, dp_mesh=dp_mesh, pp_mesh=pp_mesh,
                                         tied=tied)
        scheduler.step()
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
    result["final"] = gather_stages(modules, pp_mesh)
    return result


def gather_stages(modules, pp_mesh) -> dict[str, torch.Tensor]:
    """Full weights of every stage, collected on every rank."""
    mine = {}
    for m in modules:
        mine.update(full_weights(m))
    everyone = [None] * pp_mesh.size()
    dist.all_gather_object(everyone, mine, group=pp_mesh.get_group())
    return {k: v for d in everyone for k, v in d.items()}


def run(layout: str | None, model_overrides: dict | None = None) -> dict:
    """``layout=None``: the single-process reference (no process group, plain tensors)."""
    dims, strategy, overrides = LAYOUTS[layout] if layout else ({}, "FULL_SHARD", model_overrides or {})
    dims = dict(dims)
    resume_ep = dims.pop("resume_ep", None)
    ac, compiled = dims.pop("ac", "none"), dims.pop("compile", False)
    accum, sync = dims.pop("accum", 1), dims.pop("sync", "microbatch")
    model = build(overrides)
    dp_rank, dp_size, dp_mesh, tp_mesh = 0, 1, None, None
    if layout is not None:
        mesh = ParallelDims(**dims).build_mesh()
        model = parallelize(model, mesh, sharding_strategy=strategy, ep=dims.get("ep", 1),
                            sequence_parallel=layout not in NO_SEQUENCE_PARALLEL, activation_checkpoint=ac,
                            compile=compiled)
        dp_mesh, tp_mesh = submesh(mesh, "dp"), submesh(mesh, "tp")
        if dp_mesh is not None:
            dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    model.init_weights(seed=0)
    result = {"init": full_weights(model), "losses": [], "grad_norms": []}
    optimizer, scheduler = optimizer_and_schedule([model], overrides)
    per_rank = BATCH // dp_size
    for step, tokens in enumerate(batches(model.cfg.vocab_size)):
        if resume_ep is not None and step == STEPS // 2:
            model, optimizer, scheduler = resumed_under(resume_ep, model, optimizer, scheduler, mesh, strategy,
                                                        overrides, CHECKPOINTS / layout)
        local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        counted = dims.get("ep", 1) > 1 or accum > 1
        with counting_collectives(mesh if counted and step == 0 else None) as comm:
            loss, norm = train_step(model, optimizer, [(c[:, :-1], c[:, 1:]) for c in local.chunk(accum)],
                                    max_norm=MAX_NORM, loss_parallel=tp_mesh is not None, dp_mesh=dp_mesh,
                                    gradient_sync=sync)
        if comm is not None:  # what each rank's first step sent, by mesh dimension and kind (the dry run's counter)
            result["collectives"] = [None] * dist.get_world_size()
            dist.all_gather_object(result["collectives"], dict(comm.stats.rows))
        scheduler.step()
        result["losses"].append(loss)
        result["grad_norms"].append(norm)
    result["final"] = full_weights(model)
    result["experts"] = where_experts_live(model)
    return result


@contextlib.contextmanager
def chosen_loss(overrides: dict):
    """overrides' chunked_loss=N: train with [training] chunked_loss, N fp32 elements a chunk."""
    if not overrides.get("chunked_loss"):
        yield
        return
    default, chunked_loss.CHUNK_ELEMENTS = chunked_loss.CHUNK_ELEMENTS, overrides["chunked_loss"]
    training_step.select_loss(chunked=True)
    try:
        yield
    finally:
        training_step.select_loss()
        chunked_loss.CHUNK_ELEMENTS = default


@contextlib.contextmanager
def counting_collectives(mesh):
    """planning/collectives.py's counter of the dry run, here on a real step; None: off."""
    if mesh is None:
        yield None
        return
    from meshtrain.planning.collectives import CountCollectives, mesh_group_names

    comm = CountCollectives(mesh_group_names(mesh))
    with comm:
        yield comm


def resumed_under(ep: int, model, optimizer, scheduler, mesh, strategy: str, overrides: dict, path: Path):
    """Save model and optimizer with DCP as training/checkpoint.py does, then build the model
    again under expert-parallel degree ``ep`` and load them into it (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from meshtrain.training.checkpoint import _FLAT, model_state, optimizer_state

    dcp.save({"model": model_state([model]), "optimizer": optimizer_state([model], optimizer)}, checkpoint_id=path)
    schedule = scheduler.state_dict()
    new = parallelize(build(overrides), mesh, sharding_strategy=strategy, ep=ep)
    new.init_weights(seed=1)  # other weights: the checkpoint's must replace every one
    new_optimizer, new_scheduler = optimizer_and_schedule([new])
    state = {"model": model_state([new]), "optimizer": optimizer_state([new], new_optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(new, state["model"], options=StateDictOptions(strict=True))
    inner = new_optimizer.optimizers[0]  # one part: one torch optimizer
    full = get_optimizer_state_dict(new, inner, options=_FLAT)
    full.update({k: v for k, v in state["optimizer"].items() if k in full})
    set_optimizer_state_dict(new, inner, full, options=_FLAT)
    new_scheduler.load_state_dict(schedule)
    return new, new_optimizer, new_scheduler


def where_experts_live(model) -> dict[str, tuple]:
    """For each routed-experts weight: (mesh dimension names, their sizes, placements), ()
    for a plain tensor: what says whether expert parallelism split it."""
    out = {}
    for name, module in getattr(model, "expert_modules", dict)().items():
        for key, p in module.named_parameters():
            out[f"{name}.{key}"] = ((p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape), tuple(map(str, p.placements)))
                                    if isinstance(p, DTensor) else ())
    return out


# ---------------------------------------------------------------- faults a parallel trainer really has

FAULTS = ("no_clip", "loss_not_divided", "grads_summed", "stage_left_out_of_norm", "lr_off_by_one")
# A mixture of experts' own faults, each on a layout it shows in (run in the same start-up).
# Muon's: each rank orthogonalises its own shard of a matrix instead of the whole matrix.
MUON_FAULTS = ("muon_fsdp4+shard_orthogonalised_alone", "muon_dp2_tp2+shard_orthogonalised_alone")
MOE_FAULTS = ("moe_fsdp4+misrouted_token", "moe_fsdp4+loads_not_summed", "moe_pp2_dp2+balance_loss_unscaled",
              "moe_ep2_fsdp4+combine_misplaced", "moe_ep2_fsdp4_ac_full+recompute_misrouted")
# Expert parallelism quietly left out: the numbers still match (experts replicated under plain
# FSDP are correct too); the check of where the experts live must catch it.
EP_FAULTS = ("moe_ep2_fsdp4+experts_not_split",)


@contextlib.contextmanager
def injected(fault: str | None, dims: dict):
    """Break one thing, for the duration of one layout's run: the parity check must then fail
    (tests/test_parity.py::test_parity_check_catches_each_fault)."""
    import meshtrain.training.muon as muon
    import meshtrain.parallel.compose as compose
    import meshtrain.training.step as step
    from meshtrain.parallel.expert_parallel import ExpertParallel

    orthogonalise_group = muon._orthogonalise_group
    clip, loss_fn, schedule = step.clip_grad_norm_, step.pipeline_loss_fn, globals()["optimizer_and_schedule"]
    moe_methods = (GroupedExperts.forward, MoETransformer.after_optimizer_step, MoETransformer.set_loss_scale)
    combine, apply_ep = ExpertParallel._combine, compose.apply_ep
    if fault == "no_clip":  # the norm is still computed and reported; nothing is scaled
        step.clip_grad_norm_ = lambda params, max_norm, **kw: clip(params, 0.0, **kw)
    elif fault == "stage_left_out_of_norm":  # each pipeline stage clips by its own norm
        step.clip_grad_norm_ = lambda params, max_norm, **kw: clip(params, max_norm, **{**kw, "pp_mesh": None})
    elif fault == "loss_not_divided":  # micro-batch mean losses summed, not averaged
        step.pipeline_loss_fn = lambda n: step.cross_entropy  # a plain loss_fn: used as it is
    elif fault == "grads_summed":  # the data-parallel reduction sums instead of averaging
        dp = dims.get("dp_shard", 1) * dims.get("dp_replicate", 1)

        def summed(params, max_norm, **kw):
            params = list(params)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(dp)  # what a sum over dp ranks gives, where the mean was due
            return clip(params, max_norm, **kw)
        step.clip_grad_norm_ = summed
    elif fault == "lr_off_by_one":  # the schedule one step ahead
        def ahead(parts, overrides=None):
            optimizer, scheduler = schedule(parts, overrides)
            scheduler.step()
            return optimizer, scheduler
        globals()["optimizer_and_schedule"] = ahead
    elif fault == "misrouted_token":  # dispatch sends two token copies to each other's expert
        forward = GroupedExperts.forward

        def swapped(self, x_sorted, tokens_per_expert):
            x_sorted = x_sorted.clone()
            x_sorted[[0, -1]] = x_sorted[[-1, 0]]
            return forward(self, x_sorted, tokens_per_expert)
        GroupedExperts.forward = swapped
    elif fault == "recompute_misrouted":  # activation checkpointing's recomputation routes differently
        forward = GroupedExperts.forward

        def swapped_when_recomputed(self, x_sorted, tokens_per_expert):
            # The same ops both times (checkpoint checks what the recomputation saves), and
            # only inside backward, the recomputation, two rows swapped.
            order = torch.arange(x_sorted.shape[0], device=x_sorted.device)
            if torch._C._current_graph_task_id() != -1:
                order[[0, -1]] = order[[-1, 0]]
            return forward(self, x_sorted[order], tokens_per_expert)
        GroupedExperts.forward = swapped_when_recomputed
    elif fault == "loads_not_summed":  # each rank moves its bias by its own tokens' loads only
        update = MoETransformer.after_optimizer_step
        MoETransformer.after_optimizer_step = lambda self, sum_over=(): update(self, sum_over=())
    elif fault == "balance_loss_unscaled":  # the step never tells the model its loss scale
        MoETransformer.set_loss_scale = lambda self, scale: None
    elif fault == "shard_orthogonalised_alone":
        def alone(updates, newton_schulz):
            return [DTensor.from_local(newton_schulz(u.to_local()), u.device_mesh, u.placements, run_check=False,
                                      shape=u.shape, stride=u.stride()) for u in updates]
        muon._orthogonalise_group = alone
    elif fault == "combine_misplaced":  # the combine hands two results back to each other's token
        def misplaced(self, module, out, device_mesh):
            out = out.clone()
            out[[0, -1]] = out[[-1, 0]]
            return combine(self, module, out, device_mesh)
        ExpertParallel._combine = misplaced
    elif fault == "experts_not_split":  # ep asked for, every rank still holds every expert
        compose.apply_ep = lambda model, mesh, ep: []
    elif fault is not None:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    try:
        yield
    finally:
        step.clip_grad_norm_, step.pipeline_loss_fn = clip, loss_fn
        globals()["optimizer_and_schedule"] = schedule
        GroupedExperts.forward, MoETransformer.after_optimizer_step, MoETransformer.set_loss_scale = moe_methods
        muon._orthogonalise_group = orthogonalise_group
        ExpertParallel._combine, compose.apply_ep = combine, apply_ep


CHECKPOINTS = Path(".")  # where resumed layouts save (set below: the output folder)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    CHECKPOINTS = out / "checkpoints"
    for name in sys.argv[2:]:  # LAYOUT or LAYOUT+FAULT
        layout, _, fault = name.partition("+")
        overrides = PP_LAYOUTS[layout][2].get("model", {}) if layout in PP_LAYOUTS else LAYOUTS[layout][2]
        with injected(fault or None, (PP_LAYOUTS if layout in PP_LAYOUTS else LAYOUTS)[layout][0]), \
                chosen_loss(overrides):
            result = run_pipeline(layout) if layout in PP_LAYOUTS else run(layout)
            result["loss_function"] = training_step._loss_impl.__name__  # what the steps' losses went through
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    shutdown_distributed()
