"""The planner's estimate of a layout: memory per GPU by category (planning/memory.py),
step time by part (planning/step_time.py), tokens/s/GPU and MFU. `planning.plan` ranks
layouts by it; for one given config, not a search:

    meshtrain estimate --config llama70b_2d --world-size 64 --gpu h100-80gb [--json]

The dry run (`meshtrain dry-run --gpu ...`) prints this estimate beside its traced peak,
so the two say whether they agree. Formulas, not measurements: docs/planning.md says
how far they are from traced and measured steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field

from meshtrain.models import registry
from meshtrain.parallel.layout import ParallelDims
from meshtrain.physics.gpus import GIB, GPUS, HEADROOM, get_gpu, usable_bytes
from meshtrain.planning import hardware
from meshtrain.planning.memory import Memory, memory_per_gpu
from meshtrain.planning.report import format_breakdown
from meshtrain.planning.shape import PLANNED_SCHEDULES, Job, ModelShape
from meshtrain.planning.step_time import ASYNC_TP_HIDES, step_time


@dataclass
class Estimate:
    layout: ParallelDims
    memory: Memory
    step_time: float
    tokens_per_s_per_gpu: float
    mfu: float
    comm_bytes: dict[str, float]   # per GPU per step, sent, by mesh dimension
    times: dict[str, float]        # seconds per step: compute, tp, pp, bubble, fsdp, contention, fsdp_copies, clip, optimizer
    fsdp_comm_time: float          # all of FSDP's collectives, hidden or not
    compute_split: dict[str, float] = field(default_factory=dict)  # compute: matmul, attention, memory-bound
    warnings: list[str] = field(default_factory=list)  # what the layout does that a user should know
    moe_imbalance: float = 1.0     # the routing imbalance assumed (Job.moe_imbalance), for the report


def network_warnings(job: Job, lay: ParallelDims) -> list[str]:
    """TP (and CP) groups larger than a node: train.py accepts them (with a warning), the
    estimate prices their collectives over the network; the report says so."""
    net, out = job.net, []
    for dim, size, stride in (("tp", lay.tp, 1), ("cp", lay.cp, lay.tp)):
        if net.nodes_spanned(size, stride) > 1:
            out.append(f"{dim}={size} spans {net.nodes_spanned(size, stride)} nodes of {job.gpus_per_node} GPUs: "
                       f"its collectives (several per block, on the critical path) cross the network, priced at "
                       f"{net.bus_bandwidth(size, stride) / 1e9:.0f} GB/s per GPU, not NVLink's "
                       f"{net.bus_bandwidth(1, 1) / 1e9:.0f}")
    return out


def tp_plan_warnings(job: Job, lay: ParallelDims) -> list[str]:
    """[lora] under TP: its wrapped Linears each reduce their own input gradient (parallel/
    lora.py's plan), collectives planning/step_time.py's `tp_collectives` does not count."""
    if lay.tp == 1 or not job.lora:
        return []
    return [f"tp={lay.tp} with [lora]: each adapted Linear reduces its own input gradient in backward; the "
            f"estimate counts the base plan's TP collectives only, so its TP time is low"]


def estimate(job: Job, lay: ParallelDims) -> Estimate:
    """Memory per GPU and step time of ``lay``, and the throughput and MFU they make."""
    t = step_time(job, lay)
    m, tokens = job.model, job.global_batch * job.seq_len
    tps = tokens / t.seconds / job.world
    model_flops = m.flops_per_token(job.seq_len)  # physics/flops.py: train.py's MFU counts the same
    return Estimate(
        layout=lay, memory=memory_per_gpu(job, lay), step_time=t.seconds, tokens_per_s_per_gpu=tps,
        mfu=tps * model_flops / job.gpu.peak_bf16_flops, comm_bytes=t.comm_bytes, times=t.times,
        fsdp_comm_time=t.fsdp_comm_time, compute_split=t.compute_split,
        warnings=job.net.doubts() + network_warnings(job, lay) + tp_plan_warnings(job, lay),
        moe_imbalance=job.moe_imbalance)


# ---------------------------------------------------------------- a train.py config

class NotModelled(ValueError):
    """The config uses something the formulas do not cover; the message says what."""


def planner_job(cfg, layout: ParallelDims, model, world_size: int, gpus_per_node: int, gpu, topology=None) -> Job:
    """The planner's Job for a train.py config whose layout train.py resolved
    (training.recipe.plan_layout: the layout the planner then estimates, as it is) and whose
    model it built (``model``, on meta). NotModelled for what the formulas lack."""
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    if layout.ac == "selective" and ac.selective_every != 2:
        raise NotModelled(f"[activation_checkpoint] mode = \"{ac.mode}\"" +
                          (f", selective_every = {ac.selective_every}" if ac.mode == "selective" else "") +
                          ": the planner knows none, full, op, and selective with every 2nd block")
    if layout.pipelined and layout.pp_schedule not in PLANNED_SCHEDULES:
        raise NotModelled(f"pp_schedule = \"{layout.pp_schedule}\": the formulas know {', '.join(PLANNED_SCHEDULES)}")
    if p.pp_layers_per_stage or p.pp_split_points:
        raise NotModelled("a hand-placed pipeline split: the formulas split layers evenly")
    model_cfg = model.cfg
    if registry.get(cfg.model.name).flavors:
        from meshtrain.training.recipe import shape_overrides  # [model] dim, n_heads, ...

        dims = {k: v for k, v in shape_overrides(cfg).items() if k != "n_layers"}
        if cfg.model.name == "moe":  # [moe]'s settings over the flavor's (top_k, n_dense_layers, ...)
            dims.update({k: v for k, v in cfg.moe.overrides().items() if k in ("n_experts", "top_k", "n_dense_layers")})
        shape = ModelShape.from_flavor(cfg.model.flavor, model_cfg.vocab_size, cfg.model.name, **dims)
    else:  # a model from its own config file (name = "hf"): counted on the model itself
        shape = ModelShape.from_model(model, flavor=cfg.model.name, n_layers=model_cfg.n_layers,
                                      family=cfg.model.name, learned_positions=model.learned_positions())
    shape = dataclasses.replace(shape, n_layers=model_cfg.n_layers)  # [model] n_layers may override
    per_node = min(gpus_per_node, world_size)
    counts = [(p.numel(), p.requires_grad) for p in model.parameters()]
    trainable = sum(n for n, grad in counts if grad) / sum(n for n, _ in counts)
    muon, muon_shapes = 0.0, ()
    if cfg.optimizer.name == "Muon":
        from meshtrain.planning.muon import hidden_shapes

        muon, muon_shapes = hidden_shapes(model, registry.get(cfg.model.name).output_layer)
    return Job(shape, gpu, world_size // per_node, per_node, cfg.training.seq_len, cfg.training.global_batch_size,
               compiled=cfg.compile.enable, trainable=trainable, muon=muon, clip=cfg.training.max_norm > 0,
               tp_overlap=ASYNC_TP_HIDES if cfg.compile.async_tp else 0.0,
               muon_shapes=muon_shapes, ns_steps=cfg.optimizer.ns_steps,
               float8=cfg.float8.recipe if cfg.float8.enable else "",
               float8_all_gather=cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather,
               lora=(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.target_modules)) if cfg.lora.enable else (),
               chunked_loss=cfg.training.chunked_loss, compiled_loss=cfg.compile.loss,
               # Hugging Face models' TP plans never apply sequence parallelism (models/hf/model.py)
               sequence_parallel=cfg.parallelism.sequence_parallel and cfg.model.name != "hf",
               loss_parallel=cfg.parallelism.loss_parallel,
               reduce_dtype=cfg.training.mixed_precision_reduce,
               topology=dataclasses.replace(topology, gpus_per_node=per_node) if topology else None)


def estimate_config(cfg, world_size: int, gpus_per_node: int, gpu, topology=None) -> Estimate:
    """Build the config's model on meta and resolve its layout as train.py does (every
    check applies), then estimate it. Raises NotModelled for what the formulas lack."""
    from meshtrain.training import recipe

    model = recipe.build_model(cfg, tokenizer_vocab=1)
    layout = recipe.plan_layout(cfg, model, world_size, gpus_per_node=gpus_per_node, this_machine=False)
    e = estimate(planner_job(cfg, layout, model, world_size, gpus_per_node, gpu, topology), layout)
    e.warnings += precision_warnings(cfg)
    return e


def precision_warnings(cfg) -> list[str]:
    """The formulas time and count a step with bf16 matmuls and gathers (what the large
    configs set); a config that computes in another dtype is estimated as if it did. The
    reduce dtype, fp32 or bf16, is planned as set (Job.reduce_dtype)."""
    t = cfg.training
    if t.mixed_precision_param == "bfloat16":
        return []
    return [f'[training] mixed_precision_param = "{t.mixed_precision_param}": the estimate assumes "bfloat16" '
            f'(bf16 matmuls, activations and gathers), so its compute, traffic and memory are not this config\'s']


def as_dict(e: Estimate, gpu) -> dict:
    m = e.memory
    return {"memory_gib": {k: getattr(m, k) / GIB for k in ("params", "grads", "optimizer", "activations",
                                                            "transient")} | {"total": m.total / GIB},
            "usable_gib": usable_bytes(gpu) / GIB, "headroom": HEADROOM, "fits": m.total <= usable_bytes(gpu),
            "step_seconds": e.step_time, "times": e.times, "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
            "mfu": e.mfu, "sent_gb_per_gpu": {k: v / 1e9 for k, v in e.comm_bytes.items()}, "warnings": e.warnings}


def main(argv: list[str] | None = None) -> int:
    from meshtrain.training.config import ConfigError
    from meshtrain.training.config_loader import load_config
    from meshtrain.parallel import LayoutError

    ap = argparse.ArgumentParser(prog="meshtrain estimate", description=__doc__.split("\n\n")[0],
                                 epilog="Every config key can be overridden, as for meshtrain train and dry-run: "
                                        "--section.key=value (e.g. --parallelism.tp=8).")
    ap.add_argument("--config", required=True, help="a configs/ name or a TOML file")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    hardware.add_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args, overrides = ap.parse_known_args(argv)
    try:
        try:
            gpu = get_gpu(args.gpu)
        except KeyError as err:  # only the GPU's name: a KeyError elsewhere is a bug
            raise ConfigError(f"--gpu {args.gpu}: {err.args[0]}") from None
        net = hardware.from_arguments(args, gpu, args.gpus_per_node)
        cfg = load_config(args.config, overrides)
        e = estimate_config(cfg, args.world_size, args.gpus_per_node, gpu, net)
    except (ConfigError, LayoutError, NotModelled, hardware.TopologyError) as err:
        print(f"meshtrain: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_dict(e, gpu), indent=1))
    else:
        print(format_breakdown(e, gpu, f"{cfg.job.name} at {args.world_size} ranks on {gpu.name}"))
        print(f"  throughput: {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {e.mfu:.1%}")
        print("  error bands: docs/planning.md, Validation (measured and published runs beside these estimates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
