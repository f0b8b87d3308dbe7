"""Plan a run on a laptop: trace one training step of one rank at the real world size.

    python train.py --config llama70b_2d --dry-run --world-size 64 [--rank 9]

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
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.planning.hardware import GIB as GiB
from meshtrain.planning.hardware import HEADROOM


# ---------------------------------------------------------------- communication

_COLLECTIVES = {  # op name -> (kind, which tensor's size is the payload)
    "_allgather_base_": ("all-gather", "out"), "allgather_into_tensor_coalesced_": ("all-gather", "out"),
    "all_gather_into_tensor": ("all-gather", "out"), "_reduce_scatter_base_": ("reduce-scatter", "in"),
    "reduce_scatter_tensor": ("reduce-scatter", "in"), "reduce_scatter_tensor_coalesced_": ("reduce-scatter", "in"),
    "allreduce_": ("all-reduce", "in"), "all_reduce": ("all-reduce", "in"),
    "broadcast_": ("broadcast", "in"), "send": ("send/recv", "in"), "recv_": ("send/recv", "in"),
    "alltoall_base_": ("all-to-all", "in"), "all_to_all_single": ("all-to-all", "in"),
}


@dataclass
class CommStats:
    """Collectives by (mesh dimension, kind): count, payload bytes, and the bytes one rank
    sends with ring algorithms: all-gather / reduce-scatter (n-1)/n of the full tensor,
    all-reduce twice that; an all-to-all keeps 1/n of its input and sends the rest."""
    rows: dict = field(default_factory=dict)

    def add(self, dim: str, kind: str, payload: int, n: int, times: float = 1) -> None:
        factor = {"all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-to-all": (n - 1) / n,
                  "all-reduce": 2 * (n - 1) / n}.get(kind, 1.0)
        count, total, sent = self.rows.get((dim, kind), (0, 0, 0.0))
        self.rows[(dim, kind)] = (count + times, total + payload * times, sent + payload * factor * times)


class CountCollectives(TorchDispatchMode):
    """Sees every c10d / functional collective as it is dispatched (the fake group makes
    them no-ops) and files it under the mesh dimension its group belongs to."""

    def __init__(self, group_names: dict[str, tuple[str, int]]):
        super().__init__()
        self.group_names, self.stats, self.phase = group_names, CommStats(), ""
        self.stage_io = {}  # pipeline stage -> ((input shape, dtype), (output shape, dtype))
        # (dimension, kind) -> how many times the step repeats what is being traced now
        self.scale = lambda dim, kind: 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name in _COLLECTIVES:
            kind, which = _COLLECTIVES[name]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            tensor = tensors[0] if which == "out" or len(tensors) == 1 else tensors[-1]
            if name in ("allreduce_", "broadcast_"):
                tensor = tensors[0]
            self.on_collective(kind, tensor, args)
        return func(*args, **(kwargs or {}))

    def on_collective(self, kind: str, payload: torch.Tensor, args) -> None:
        dim, n = self._group(args)
        self.stats.add(dim, kind, payload.numel() * payload.element_size(), n, self.scale(dim, kind))

    def _group(self, args) -> tuple[str, int]:
        for a in args:
            if isinstance(a, str) and a in self.group_names:
                return self.group_names[a]
            if type(a).__name__ == "ScriptObject":
                try:
                    pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
                except Exception:
                    continue
                return self.group_names.get(pg.group_name, (f"group of {pg.size()}", pg.size()))
        return "?", 1


def mesh_group_names(mesh) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dimension(s), size), for the groups this rank is in."""
    names = {}
    dims = mesh.mesh_dim_names or ()
    for dim in dims:
        names[mesh[dim].get_group().group_name] = (dim, mesh[dim].size())
    for i in range(len(dims)):  # flattened groups (dp, clipping's whole-mesh groups)
        for j in range(i + 2, len(dims) + 1):
            sub = mesh[dims[i:j]]
            try:
                flat = sub._flatten()
            except Exception:
                continue
            names.setdefault(flat.get_group().group_name, ("x".join(dims[i:j]), flat.size()))
    return names


# ---------------------------------------------------------------- memory

_in_sharding_propagation = threading.local()


@contextlib.contextmanager
def sharding_propagation_untracked():
    """DTensor works out an op's output shape by running the op on fake tensors of the
    *global* shape (`ShardingPropagator._propagate_tensor_meta_non_cached`): no memory on
    a GPU. torch's trackers skip them by checking that they run under a fake mode of their
    own, which is not so when the whole step is fake: the propagation reuses our mode, and
    the tracker counted a 128K-vocabulary fp32 logit tensor per loss-parallel op (17.5
    GiB of a 70B tp 8 step that needs 4). This marks the propagation so the tracker skips it."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self, op_schema):
        _in_sharding_propagation.on = True
        try:
            return original(self, op_schema)
        finally:
            _in_sharding_propagation.on = False

    ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _peak_only(tracker_cls):
    """The tracker keeps a snapshot per module at every op (hundreds of modules x every op
    of a 70B step); only the rank's overall peak is reported here, so skip the rest. And
    tensors of DTensor's sharding propagation are not memory (see above)."""
    class PeakOnly(tracker_cls):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def _track(self, reftype, t) -> None:
            if not getattr(_in_sharding_propagation, "on", False):
                super()._track(reftype, t)
    return PeakOnly


def memory_tracker(parts, optimizers):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if len(parts) == 1 and isinstance(parts[0], FSDPModule):
        return _peak_only(FSDPMemTracker)(parts[0], optimizers.optimizers[0])
    tracker = _peak_only(MemTracker)()
    tracker.track_external(*parts, *optimizers.optimizers)
    return tracker


def breakdown(snapshot: dict) -> dict[str, int]:
    """The tracker's categories, grouped as people ask about them."""
    get = lambda *keys: sum(v for k, v in snapshot.items() if k in keys)
    return {
        "parameters": get("Sharded Param", "Unsharded Param", "Parameter"),
        "buffers": get("Buffer"),
        "gradients": get("Sharded Grad", "Unsharded Grad", "Gradient"),
        "optimizer state": get("OptState", "Optstate"),
        "activations": get("Activation"),
        "temporaries": get("Temp", "Inputs", "Input"),
        "collective buffers": get("All Gather", "Reduce Scatter"),
        "total": snapshot["Total"],
    }


# ---------------------------------------------------------------- the run

def in_flight(schedule: str, n_micro: int, stage: int, n_stages: int) -> int:
    """For schedules without an F/B action model (the zero-bubble ones): micro-batches
    whose activations one stage holds at once, the 1F1B family's count."""
    return n_micro if schedule in ("GPipe", "LoopedBFS") else min(n_micro, n_stages - stage)


def rank_seq(cfg, layout) -> int:
    """Tokens of each sequence this rank holds: its piece under context parallelism."""
    return cfg.training.seq_len // layout.dims.cp


def activation_seq(cfg, layout) -> int:
    """Sequence length of the activations between blocks: this rank's piece of the
    sequence (`rank_seq`), divided by tp under sequence parallel."""
    tp, seq = layout.dims.tp, rank_seq(cfg, layout)
    return seq // tp if (tp > 1 and cfg.parallelism.sequence_parallel) else seq


def trace_step(cfg, layout, mesh, parts, optimizers, model_cfg, comm, tracker, actions=None) -> str:
    """One training step of this rank on fake tensors (see the module docstring). Of the
    step's gradient-accumulation micro-batches one is traced: each is the same work and
    frees its activations before the next, so the peak is the same; its collectives are
    counted once per micro-batch. Under a pipeline ``actions`` (default: this rank's
    schedule, up to its last new state) are the forwards and backwards run. ``comm.phase`` names the
    part of the step running, for reports. Returns what was traced, in words."""
    from meshtrain.parallel import clip_grad_norm_, loss_parallel_context, submesh
    from meshtrain.training.step import cross_entropy

    t = cfg.training
    local, accum = layout.local_batch, layout.grad_accum
    loss_parallel = layout.dims.tp > 1 and cfg.parallelism.loss_parallel

    if layout.stage_layers is None:
        comm.scale = lambda dim, kind: accum
        tokens = torch.randint(0, model_cfg.vocab_size, (local, rank_seq(cfg, layout)))
        with loss_parallel_context(loss_parallel):
            comm.phase = "forward"
            loss = cross_entropy(parts[0][1](tokens), tokens)
            comm.phase = "backward"
            loss.backward()
        traced = (f"the last of {accum} accumulation micro-batches of {local} sequences (the gradients of "
                  f"the others held)" if accum > 1 else f"one micro-batch of {local} sequences")
    else:
        traced = _trace_pipeline(cfg, layout, parts, model_cfg, comm, tracker, loss_parallel, actions)
        traced += f"; x {accum} accumulation steps" if accum > 1 else ""
    comm.scale, comm.phase = (lambda dim, kind: 1), "gradient clipping"
    pp_mesh = submesh(mesh, "pp")
    clip_grad_norm_([q for _, part in parts for q in part.parameters()], t.max_norm or 1.0, pp_mesh=pp_mesh)
    comm.phase = "optimizer step"
    if not all(opt.defaults.get("fused") for opt in optimizers.optimizers):
        optimizers.step()
    # A fused AdamW step updates parameters and state in place and allocates nothing once
    # its state exists, so it cannot move the peak. It is not traced: under fake tensors
    # some torch versions (2.11) run its out-of-place form, which would count a whole
    # second copy of parameters, gradients and state (measured on an H100: 64 GiB
    # predicted for a 43 GiB step).
    return traced


def pipeline_actions(layout, stage_ids: list[int]) -> list:
    """This rank's forwards and backwards in the order torch's schedule runs them, up to
    the last new state of its step and drained (planning/schedule.py `replay_prefix`). Each
    stage's unsharded gradients grow from its first backward to the step's end, so the
    peak may come late (a replay cut right after every stage's first backward missed 7 of
    45 GiB on Llama 3 8B, pp 2 interleaved). For a schedule without an F/B model, each
    stage's in-flight forwards then their backwards, one stage after another."""
    from meshtrain.planning.schedule import SUPPORTED, Action, rank_actions, replay_prefix

    pp, n_micro = layout.dims.pp, layout.n_microbatches
    if layout.schedule in SUPPORTED and layout.placement == "loop":
        actions = rank_actions(layout.schedule, pp, layout.stages_per_rank, n_micro)[stage_ids[0] % pp]
        return replay_prefix(actions)
    n_stages, out = len(layout.stage_layers), []
    for s in stage_ids:
        k = in_flight(layout.schedule, n_micro, s, n_stages)
        out += [Action("F", s, i) for i in range(k)] + [Action("B", s, i) for i in reversed(range(k))]
    return out


def _trace_pipeline(cfg, layout, parts, model_cfg, comm, tracker, loss_parallel, actions=None) -> str:
    """Replay this rank's forwards and backwards (see `pipeline_actions`). As torch's
    PipelineStage does, FSDP neither reshards nor reduces after a backward until the
    stage's last one, so every local stage's unsharded gradients accumulate meanwhile."""
    from meshtrain.parallel import loss_parallel_context
    from meshtrain.training.step import cross_entropy

    t, n_micro, accum = cfg.training, layout.n_microbatches, layout.grad_accum
    n_stages, mb, seq = len(layout.stage_layers), layout.local_batch // layout.n_microbatches, activation_seq(cfg, layout)
    dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else torch.float32
    by_stage = dict(parts)
    actions = actions or pipeline_actions(layout, list(by_stage))
    forwards = {s: sum(a.kind == "F" and a.stage == s for a in actions) for s in by_stage}
    pending = {}
    for a in actions:
        part, scale = by_stage[a.stage], n_micro * accum / forwards[a.stage]
        # TP collectives happen per micro-batch, FSDP's per schedule step (once per
        # accumulation step): scale what was traced to the whole step.
        comm.scale = lambda dim, kind, scale=scale: scale if dim == "tp" else accum
        with loss_parallel_context(loss_parallel):
            if a.kind == "F":
                # The tracker refuses a second top-level call of a module it has seen (it
                # takes it for the next step); forgetting the stage's root is enough, and
                # keeps what the pending backwards of other micro-batches look up.
                if tracker is not None:
                    tracker.memory_tracking.pop(part, None)
                x = (torch.randint(0, model_cfg.vocab_size, (mb, rank_seq(cfg, layout))) if a.stage == 0 else
                     torch.randn(mb, seq, model_cfg.dim, dtype=dtype, requires_grad=True))
                comm.phase = f"forward of stage {a.stage}, micro-batch {a.microbatch}"
                out = part(x)
                comm.stage_io[a.stage] = ((tuple(x.shape), x.dtype), (tuple(out.shape), out.dtype))
                labels = torch.zeros(mb, rank_seq(cfg, layout), dtype=torch.long)
                pending[a.stage, a.microbatch] = (cross_entropy(out, labels)
                                                  if a.stage == n_stages - 1 else out), x
                continue
            out, x = pending.pop((a.stage, a.microbatch))
            comm.phase = f"backward of stage {a.stage}, micro-batch {a.microbatch}"
            if isinstance(part, FSDPModule):  # as PipelineStage.backward_one_chunk sets them
                part.set_is_last_backward(False)
                part.set_reshard_after_backward(False)
                part.set_requires_gradient_sync(False)
            out.backward(None if out.ndim == 0 else torch.ones_like(out))
            # The input's gradient is sent back to the previous stage, then both are dropped.
            # Free the input's storage too: torch's module tracker keeps the tensor itself
            # referenced (its grad hooks), which held 32 MiB per micro-batch of a 70B stage.
            x.grad = None
            if x.dtype.is_floating_point:
                x.untyped_storage().resize_(0)
    # After the step's last backward the schedule reduces each stage's accumulated
    # gradients (its REDUCE_GRAD action): torch's own method, on each traced stage.
    from torch.distributed.pipelining.stage import _PipelineStageBase
    comm.phase = "gradient reduction"
    comm.scale = lambda dim, kind: accum
    for s, part in parts:
        _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=part), 1)
    held = ", ".join(f"stage {s}: {forwards[s]}" for s in by_stage)
    return f"{layout.schedule} order of this rank up to its last new state, drained; forwards traced ({held}) of {n_micro} micro-batches"


def init_optimizer_state(parts, optimizers, accumulating: bool = False) -> None:
    """AdamW allocates its state on its first step; a steady-state step has it all along,
    so it exists before the traced step (one step on zero gradients, not tracked). With
    gradient accumulation the traced micro-batch is a later one: the sharded gradients of
    the earlier ones are already there (train_step sets them to None only at step start)."""
    for part in parts:
        for q in part.parameters():
            q.grad = torch.zeros_like(q)
    optimizers.step()
    optimizers.zero_grad(set_to_none=not accumulating)


def init_fake_world(rank: int, world_size: int) -> None:
    """This process becomes rank ``rank`` of a fake process group of ``world_size``."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # DTensor caches sharding decisions by mesh, and meshes of different ranks compare
    # equal: another rank's dry run in this process must not answer for this one.
    _clear_sharding_prop_cache()


def build_rank(cfg, world_size: int, gpus_per_node: int):
    """(model, layout, mesh, parts) of this rank, as train.py builds them, on meta."""
    from meshtrain.parallel.grad_clip import _whole_group
    from meshtrain.training import recipe

    cfg.job.device = "cpu"  # fake tensors live on the CPU; the layout checks are the same
    model = recipe.build_model(cfg, tokenizer_vocab=1)  # vocab from the config (or the byte tokenizer's)
    layout = recipe.plan_layout(cfg, model, world_size, gpus_per_node=gpus_per_node, this_machine=False)
    mesh = layout.dims.build_mesh("cpu")
    parts = recipe.build_parts(cfg, layout, mesh, model).parts
    for param in (q for _, m in parts for q in m.parameters()):
        if isinstance(param, DTensor):
            _whole_group(param.device_mesh)  # made now: creating groups under fake tensors fails
    return model, layout, mesh, parts


def dry_run(cfg, world_size: int, rank: int = 0, gpus_per_node: int = 8, gpu: str = "", *,
            fake: bool = True, quiet: bool = False) -> dict:
    """Build and trace rank ``rank``'s view of ``cfg`` at ``world_size``; print the report
    (unless ``quiet``) and return its numbers. ``gpu`` (e.g. "h100-80gb"): say whether the
    peak fits. ``fake=False`` runs the step on real CPU tensors instead (small models only):
    the reference tests check the fake trace against."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshtrain.parallel.mesh import LayoutError
    from meshtrain.training import recipe

    card = None
    if gpu:
        from meshtrain.planning.hardware import get_gpu
        try:
            card = get_gpu(gpu)
        except KeyError as err:
            raise LayoutError(f"--gpu={gpu}: {err.args[0]}") from None
    if rank >= world_size:
        raise LayoutError(f"--rank={rank} is outside the world of {world_size} ranks")
    started = time.perf_counter()
    init_fake_world(rank, world_size)
    try:
        say = (lambda text: None) if quiet else (lambda text: print(f"meshtrain dry run: {text}", flush=True))
        say(f"building rank {rank} of {world_size}: model on meta, mesh, TP / FSDP / pipeline stages ...")
        model, layout, mesh, parts = build_rank(cfg, world_size, gpus_per_node)
        stage_layers = layout.stage_layers
        modules = [part for _, part in parts]
        names = mesh_group_names(mesh)
        report = {"world_size": world_size, "rank": rank, "mesh": describe_mesh(mesh, rank, gpus_per_node),
                  "stages": [(i, stage_layers[i] if stage_layers else None) for i, _ in parts],
                  "parameters": _param_counts(modules, model)}
        say(f"tracing one training step on fake tensors ({time.perf_counter() - started:.0f} s so far; "
            f"about a minute for 405B at 512 ranks) ...")
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            for m in modules:
                m.to_empty(device="cpu")  # may replace parameters: the optimizer comes after
            optimizers, _ = recipe.build_optimizer(cfg, modules)
            init_optimizer_state(modules, optimizers, accumulating=layout.grad_accum > 1)
            tracker = memory_tracker(modules, optimizers)
            tracker.track_external(*optimizers.optimizers)
            comm = CountCollectives(names)
            with sharding_propagation_untracked(), tracker, comm:
                report["traced"] = trace_step(cfg, layout, mesh, parts, optimizers, model.cfg,
                                              comm, tracker)
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
            after = next(iter(tracker.get_tracker_snapshot("current").values()))
        report["memory"] = breakdown(peak)
        report["memory_between_steps"] = breakdown(after)
        report["comm"] = comm.stats.rows
        if stage_layers is not None:
            report["comm"].update(_pipeline_boundary(cfg, layout, parts, model.cfg))
        report["seconds"] = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    if card is not None:
        from meshtrain.planning.hardware import CUDA_CONTEXT, runtime_bytes
        groups = len(names)
        report["runtime"] = {"context": CUDA_CONTEXT, "nccl": runtime_bytes(groups) - CUDA_CONTEXT,
                             "communicators": groups, "total": runtime_bytes(groups)}
    if card is not None:  # after the fake world is gone: the planner's probe makes its own
        report.update(judge_fit(report["memory"]["total"], card, cfg, layout, model, world_size,
                                gpus_per_node, rank))
    if not quiet:
        print_report(report, cfg)
    return report


def judge_fit(peak: int, card, cfg, layout, model, world_size: int, gpus_per_node: int, rank: int) -> dict:
    """Fits by the planner's rule (planning.hardware.usable_bytes: the same headroom), and
    the planner's own estimate of this very layout beside the trace, so a planner-written
    config's dry run says whether the two agree."""
    from meshtrain.planning.cost import estimate
    from meshtrain.planning.estimate import NotModelled, planner_layout
    from meshtrain.planning.hardware import usable_bytes

    out = {"gpu": card.name, "capacity": card.hbm_bytes, "usable": usable_bytes(card),
           "fits": peak <= usable_bytes(card)}
    try:
        e = estimate(*planner_layout(cfg, layout, model, world_size, gpus_per_node, card))
    except NotModelled as err:
        out["estimate_missing"] = str(err)
        return out
    pp_rank = rank // (world_size // layout.dims.pp)  # pp is the outermost mesh dimension
    out["estimate"] = {"total": e.memory.total, "pp_rank": e.memory.pp_rank, "traced_pp_rank": pp_rank,
                       "fits": e.memory.total <= usable_bytes(card)}
    return out


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


def _pipeline_boundary(cfg, layout, parts, model_cfg) -> dict:
    """Send/recv per step at this rank's stage boundaries: each micro-batch's activation
    forward and its gradient backward, [micro-batch, seq (/tp with SP), dim] each."""
    t, n_stages = cfg.training, len(layout.stage_layers)
    n_micro, local, accum, seq = layout.n_microbatches, layout.local_batch, layout.grad_accum, activation_seq(cfg, layout)
    elem = 2 if t.mixed_precision_param == "bfloat16" else 4
    per_mb = (local // n_micro) * seq * model_cfg.dim * elem
    boundaries = sum((i > 0) + (i < n_stages - 1) for i, _ in parts)  # sends + receives ...
    count = boundaries * 2 * n_micro * accum                          # ... forward and backward
    return {("pp", "send/recv"): (count, count * per_mb, count * per_mb / 2)}  # half of them are sends


def format_fit(report: dict) -> str:
    need, usable, hbm = report["memory"]["total"] / GiB, report["usable"] / GiB, report["capacity"] / GiB
    rule = f"{usable:.0f} GiB usable of {hbm:.0f} on a {report['gpu']}, {HEADROOM:.0%} kept for the CUDA context, NCCL and fragmentation"
    lines = [f"fits: peak {need:.1f} GiB in {rule}" if report["fits"] else
             f"does NOT fit: peak {need:.1f} GiB, {need - usable:.1f} GiB over the {rule}"]
    if "runtime" in report:
        rt = report["runtime"]
        lines.append(f"of that headroom, what no trace sees: CUDA context {rt['context'] / GiB:.1f} GiB + NCCL buffers "
                     f"{rt['nccl'] / GiB:.2f} GiB ({rt['communicators']} communicators) = {rt['total'] / GiB:.1f} GiB "
                     f"(planning/hardware.py); the rest is for the allocator's reserve")
    if "estimate" in report:
        est = report["estimate"]
        planned = est["total"] / GiB
        which = ("" if est["pp_rank"] == est["traced_pp_rank"] else
                 f"; it is for pipeline rank {est['pp_rank']}, the fullest, and this trace is of pipeline rank "
                 f"{est['traced_pp_rank']}: trace that rank to compare like with like")
        agree = "agree" if est["fits"] == report["fits"] else "DISAGREE"
        lines.append(f"planner's estimate of this layout (python -m planning.estimate): {planned:.1f} GiB, "
                     f"the trace {100 * (need / planned - 1):+.0f}% from it; they {agree} on fits{which}")
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
