"""Plan a run on a laptop: trace one training step of one rank at the real world size.

    meshtrain dry-run --config llama70b_2d --world-size 64 [--rank 9]

What is real: the config checks, the mesh (on a fake process group of `world_size`
ranks), the meta model, the TP / FSDP / pipeline wrapping of this rank, and one whole
step — forward, loss, backward, gradient clipping, AdamW — run under FakeTensorMode, so
every op and every collective happens with shapes but no data. Memory is what torch's
FSDP memory tracker counts for the live tensors of that step (parameters, gradients,
optimizer state, activations, collective buffers), bytes per rank; communication is
every collective the step dispatches, by mesh dimension.

Under a pipeline, the schedule itself needs its neighbours, which a fake group does not
have; this rank's stages instead run the forwards its schedule keeps in flight at once
(1F1B: pp - rank for its stage; GPipe: all) then their backwards, and the boundary
traffic is computed from the activation shape.

A deep stage is traced twice, with 3 and 4 of its alike blocks, and its memory, traffic
and parameter counts extrapolated to the real depth, exactly (planning/alike_memory.py).
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.parallel.mesh import LayoutError
from meshtrain.parallel.pipeline import stage_ids
from meshtrain.physics.gpus import CUDA_CONTEXT, get_gpu, runtime_bytes, usable_bytes
from meshtrain.physics.gpus import GIB as GiB
from meshtrain.physics.gpus import HEADROOM
from meshtrain.planning.alike_blocks import KEEP, BlockTags, collapse
from meshtrain.planning.alike_memory import Shallow, Timeline, extrapolate, worth_it
from meshtrain.planning.collectives import CountCollectives, mesh_group_names
from meshtrain.planning.estimate import NotModelled, estimate, planner_job
from meshtrain.planning.fake_world import (breakdown, init_fake_world, few_collections, memory_tracker, one_thread,
                                           sharding_propagation_untracked)
from meshtrain.planning.traced_step import activation_seq, build_rank, init_optimizer_state, trace_step
from meshtrain.training import recipe


def dry_run(cfg, world_size: int, rank: int = 0, gpus_per_node: int = 8, gpu: str = "", *,
            fake: bool = True, quiet: bool = False, every_block: bool = False,
            every_microbatch: bool = False) -> dict:
    """Build and trace rank ``rank``'s view of ``cfg`` at ``world_size``; print the report
    (unless ``quiet``) and return its numbers. ``gpu`` (e.g. "h100-80gb"): say whether the
    peak fits. ``fake=False`` runs the step on real CPU tensors instead (small models only):
    the reference tests check the fake trace against. Long stretches of alike blocks are
    traced at two shallow depths and extrapolated exactly (planning/alike_memory.py),
    unless ``every_block``; a pipeline's micro-batches alike an earlier one repeat its
    record (planning/alike_microbatches.py), unless ``every_microbatch``: the references
    that are tested against."""
    with one_thread() if fake else contextlib.nullcontext(), few_collections():
        return _dry_run(cfg, world_size, rank, gpus_per_node, gpu, fake=fake, quiet=quiet, every_block=every_block,
                        copy_alike=fake and not every_microbatch)


def _dry_run(cfg, world_size: int, rank: int, gpus_per_node: int, gpu: str, *, fake: bool, quiet: bool,
             every_block: bool, copy_alike: bool) -> dict:
    card = None
    if gpu:
        try:
            card = get_gpu(gpu)
        except KeyError as err:
            raise LayoutError(f"--gpu={gpu}: {err.args[0]}") from None
    if rank >= world_size:
        raise LayoutError(f"--rank={rank} is outside the world of {world_size} ranks")
    started = time.perf_counter()
    say = (lambda text: None) if quiet else (lambda text: print(f"meshtrain dry run: {text}", flush=True))
    say(f"building rank {rank} of {world_size}: model on meta, mesh, TP / FSDP / pipeline stages ...")
    # Selective AC is refused by `collapse` itself (blocks differ by position), as for the hang check.
    shallow = fake and not every_block and cfg.optimizer.name != "Muon"
    say("tracing one training step on fake tensors ...")
    # Traced uncompiled (traced_step.build_rank); the planner's estimate beside it counts
    # what compiled blocks and a compiled loss keep.
    report = _trace(cfg, world_size, rank, gpus_per_node, fake=fake, grow=() if shallow else None, copy_alike=copy_alike)
    if "shallow" in report:
        report = _deep(cfg, world_size, rank, gpus_per_node, report, say, copy_alike)
    layout, groups = report.pop("layout"), report.pop("groups")
    report["seconds"] = time.perf_counter() - started
    if card is not None:
        report["runtime"] = {"context": CUDA_CONTEXT, "nccl": runtime_bytes(groups) - CUDA_CONTEXT,
                             "communicators": groups, "total": runtime_bytes(groups)}
        # after the fake world is gone: the planner's probe makes its own; on the whole
        # model (the traced one may have lost blocks, planning/alike_memory.py)
        report.update(judge_fit(report["memory"]["total"], card, cfg, layout,
                                recipe.build_model(cfg, tokenizer_vocab=1), world_size, gpus_per_node, rank))
    if not quiet:
        print_report(report, cfg)
    return report


def _trace(cfg, world_size: int, rank: int, gpus_per_node: int, *, fake: bool, grow, copy_alike: bool) -> dict:
    """One traced step of the rank; its report. ``grow``: None, every block is traced;
    else alike runs are cut to KEEP blocks, the run ``grow`` (a (stage, run)) to KEEP + 1,
    and the report keeps what planning/alike_memory.py extrapolates from ("shallow")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cut = tags = None
    if grow is not None:
        tags, real = {}, {}

        def cut(model, layout):
            built, kept, found = collapse(cfg, model, layout, longer_than=KEEP + 1, grow=grow or None,
                                          only_if=lambda found: worth_it(_on_rank(found, layout, rank, world_size)))
            tags.update(kept)
            real.update(_on_rank(found, layout, rank, world_size))
            return built

    init_fake_world(rank, world_size)
    try:
        model, layout, mesh, parts = build_rank(cfg, world_size, gpus_per_node, cut)
        stage_layers = layout.stage_layers
        modules = [part for _, part in parts]
        names = mesh_group_names(mesh)
        report = {"world_size": world_size, "rank": rank, "mesh": describe_mesh(mesh, rank, gpus_per_node),
                  "stages": [(i, stage_layers[i] if stage_layers else None) for i, _ in parts],
                  "parameters": _param_counts(modules, model), "layout": layout, "groups": len(names)}
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            for m in modules:
                m.to_empty(device="cpu")  # may replace parameters: the optimizer comes after
            optimizers, _ = recipe.build_optimizer(cfg, modules)
            # Sharded gradients exist before the traced micro-batch where earlier ones were
            # reduced: each pass through a pipeline, or each micro-batch of one that reduces
            # every micro-batch (without a pipeline, "step" reduces only at the traced last).
            accum = layout.grad_accum(cfg.training.global_batch_size)
            init_optimizer_state(modules, optimizers,
                                 accumulating=accum > 1 and (layout.pp > 1 or not layout.reduces_once))
            tracker = memory_tracker(modules, optimizers)
            tracker.track_external(*optimizers.optimizers)
            comm = CountCollectives(names)
            block_tags = BlockTags(parts, tags or {})
            if tags:
                tracker.timeline = Timeline(lambda: (comm.phase, block_tags.latest()))
            tracker.collectives = comm
            with sharding_propagation_untracked(), tracker, block_tags:
                report["traced"] = trace_step(cfg, layout, mesh, parts, optimizers, model.cfg, comm, tracker,
                                              copy_alike=copy_alike)
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
            after = next(iter(tracker.get_tracker_snapshot("current").values()))
        report["memory"] = breakdown(peak)
        report["memory_between_steps"] = breakdown(after)
        report["comm"] = comm.stats.rows
        if stage_layers is not None:
            report["comm"].update(_pipeline_boundary(cfg, layout, parts, model.cfg))
        if tags:
            report["shallow"] = (Shallow(tracker.timeline, after, dict(report["comm"]), report["parameters"]), real)
    finally:
        dist.destroy_process_group()
    return report


def _deep(cfg, world_size: int, rank: int, gpus_per_node: int, base: dict, say, copy_alike: bool) -> dict:
    """The report at the real depth from ``base``, the trace with alike runs cut to KEEP
    blocks: one more trace per run, with that run at KEEP + 1, and every number
    extrapolated (planning/alike_memory.py); or every block traced, when that is as cheap
    or the traces do not line up."""
    shallow, real = base["shallow"]
    say(f"and again with {KEEP + 1} blocks of each stretch of alike blocks "
        f"({', '.join(str(n) for n in real.values())} blocks), to extrapolate ...")
    grown = {run: _trace(cfg, world_size, rank, gpus_per_node, fake=True, grow=run, copy_alike=copy_alike)["shallow"][0]
             for run in real}
    found = extrapolate(shallow, grown, real)
    if found is None:
        say("the shallow traces do not line up: tracing every block ...")
        return _trace(cfg, world_size, rank, gpus_per_node, fake=True, grow=None, copy_alike=copy_alike)
    peak, after, rows, counts = found
    lengths = " + ".join(str(n) for n in real.values())
    del base["shallow"]
    return {**base, "memory": breakdown(peak), "memory_between_steps": breakdown(after), "comm": rows,
            "parameters": counts,
            "traced": base["traced"] + f"; blocks: {KEEP} and {KEEP + 1} of {lengths} alike, the rest extrapolated"}


def _on_rank(runs: dict, layout, rank: int, world_size: int) -> dict:
    """The runs of alike blocks in this rank's stages."""
    if layout.stage_layers is None:
        return runs
    mine = stage_ids(rank // (world_size // layout.pp), layout.pp, len(layout.stage_layers), layout.placement)
    return {run: n for run, n in runs.items() if run[0] in mine}


def judge_fit(peak: int, card, cfg, layout, model, world_size: int, gpus_per_node: int, rank: int) -> dict:
    """Fits by the planner's rule (physics.gpus.usable_bytes: the same headroom), and
    the planner's own estimate of this very layout beside the trace, so a planner-written
    config's dry run says whether the two agree."""
    out = {"gpu": card.name, "capacity": card.hbm_bytes, "usable": usable_bytes(card),
           "fits": peak <= usable_bytes(card)}
    try:
        e = estimate(planner_job(cfg, layout, model, world_size, gpus_per_node, card), layout)
    except NotModelled as err:
        out["estimate_missing"] = str(err)
        return out
    pp_rank = rank // (world_size // layout.pp)  # pp is the outermost mesh dimension
    out["estimate"] = {"total": e.memory.total, "optimizer": e.memory.optimizer, "pp_rank": e.memory.pp_rank,
                       "traced_pp_rank": pp_rank, "fits": e.memory.total <= usable_bytes(card),
                       "compiled": bool(cfg.compile.enable or cfg.compile.loss)}
    if out["estimate"]["compiled"] and not out["fits"] and out["estimate"]["fits"]:
        # The trace is of the uncompiled step (traced_step.build_rank); compiled, the blocks and the loss
        # keep less, which the estimate counts (held to an H100's compiled runs within 6%,
        # tests/test_compiled_memory.py).
        out["fits"], out["fits_uncompiled"] = True, False
    return out


def _pipeline_boundary(cfg, layout, parts, model_cfg) -> dict:
    """Send/recv per step at this rank's stage boundaries: each micro-batch's activation
    forward and its gradient backward, [micro-batch, seq (/tp with SP), dim] each."""
    t, n_stages = cfg.training, len(layout.stage_layers)
    n_micro, local, seq = layout.pp_microbatches, layout.local_batch, activation_seq(cfg, layout)
    accum = layout.grad_accum(t.global_batch_size)
    elem = 2 if t.mixed_precision_param == "bfloat16" else 4
    per_mb = (local // n_micro) * seq * model_cfg.dim * elem
    boundaries = sum((i > 0) + (i < n_stages - 1) for i, _ in parts)  # sends + receives ...
    count = boundaries * 2 * n_micro * accum                          # ... forward and backward
    return {("pp", "send/recv"): (count, count * per_mb, count * per_mb / 2)}  # half of them are sends


def describe_mesh(mesh, rank: int, gpus_per_node: int) -> list[str]:
    lines = [f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}, {gpus_per_node} GPUs per node"]
    for dim in mesh.mesh_dim_names:
        ranks = mesh[dim].mesh.flatten().tolist()
        nodes = sorted({r // gpus_per_node for r in ranks})
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"{len(nodes)} nodes ({_short(nodes)})"
        lines.append(f"  {dim:<13} group of rank {rank}: ranks {_short(ranks)} on {where}")
    return lines


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"


def _param_counts(modules, model) -> dict[str, int]:
    local = sum(q.to_local().numel() if isinstance(q, DTensor) else q.numel() for m in modules for q in m.parameters())
    stage = sum(q.numel() for m in modules for q in m.parameters())
    return {"model": sum(q.numel() for q in model.parameters()), "stages": stage, "held": local}


def format_fit(report: dict) -> str:
    need, usable, hbm = report["memory"]["total"] / GiB, report["usable"] / GiB, report["capacity"] / GiB
    rule = f"{usable:.0f} GiB usable of {hbm:.0f} on a {report['gpu']}, {HEADROOM:.0%} kept for the CUDA context, NCCL and fragmentation"
    if report.get("fits_uncompiled") is False:
        planned = report["estimate"]["total"] / GiB
        lines = [f"fits compiled: the planner's estimate of the compiled step is {planned:.1f} GiB in {rule}; "
                 f"this uncompiled trace peaks at {need:.1f} GiB, {need - usable:.1f} GiB over"]
    else:
        lines = [f"fits: peak {need:.1f} GiB in {rule}" if report["fits"] else
                 f"does NOT fit: peak {need:.1f} GiB, {need - usable:.1f} GiB over the {rule}"]
    if "runtime" in report:
        rt = report["runtime"]
        lines.append(f"of that headroom, what no trace sees: CUDA context {rt['context'] / GiB:.1f} GiB + NCCL buffers "
                     f"{rt['nccl'] / GiB:.2f} GiB ({rt['communicators']} communicators) = {rt['total'] / GiB:.1f} GiB "
                     f"(physics/gpus.py); the rest is for the allocator's reserve")
    if "estimate" in report:
        est = report["estimate"]
        planned = est["total"] / GiB
        which = ("" if est["pp_rank"] == est["traced_pp_rank"] else
                 f"; it is for pipeline rank {est['pp_rank']}, the fullest, and this trace is of pipeline rank "
                 f"{est['traced_pp_rank']}: trace that rank to compare like with like")
        agree = "agree" if est["fits"] == report.get("fits_uncompiled", report["fits"]) else "DISAGREE"
        # The trace runs the step eagerly; compiled blocks and a compiled loss keep less.
        compiled = ("; the trace runs the step uncompiled: under [compile] it is an upper bound, the "
                    "estimate counts what the compiled blocks and loss keep" if est.get("compiled") else "")
        lines.append(f"planner's estimate of this layout (meshtrain estimate): {planned:.1f} GiB, "
                     f"the trace {100 * (need / planned - 1):+.0f}% from it; they {agree} on fits{which}{compiled}")
    elif "estimate_missing" in report:
        lines.append(f"no planner estimate to compare: {report['estimate_missing']}")
    return "\n".join(lines)


def print_report(report: dict, cfg) -> None:
    print(f"meshtrain dry run: {cfg.job.name}, rank {report['rank']} of {report['world_size']} "
          f"(fake process group; traced in {report['seconds']:.1f} s)")
    for line in report["mesh"]:
        print(line)
    for index, layers in report["stages"]:
        if layers is not None:
            print(f"  pipeline stage {index}: layers {layers[0]}-{layers[-1]} ({len(layers)})")
    pc = report["parameters"]
    print(f"parameters: model {pc['model'] / 1e9:.2f}B, this rank's stage(s) {pc['stages'] / 1e9:.2f}B, "
          f"held by this rank (its shards) {pc['held'] / 1e6:,.1f}M")
    print(f"traced: {report['traced']}")
    unit, size = ("GiB", GiB) if report["memory"]["total"] >= GiB else ("MiB", 2**20)
    print(f"memory of this rank ({unit}):     at the peak   between steps")
    for key, value in report["memory"].items():
        print(f"  {key:<20} {value / size:12.2f} {report['memory_between_steps'][key] / size:14.2f}")
    if "fits" in report:
        print(format_fit(report))
    print("communication per step (this rank):")
    print(f"  {'dimension':<18} {'collective':<15} {'count':>6} {'payload GiB':>12} {'sent GiB':>10}")
    for (dim, kind), (count, payload, sent) in sorted(report["comm"].items()):
        print(f"  {dim:<18} {kind:<15} {round(count):>6} {payload / GiB:>12.3f} {sent / GiB:>10.3f}")
