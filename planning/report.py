"""The planner's estimates (planning/estimate.py's `Estimate`, which prints through this
file and so is not imported here) as text: one line per layout, the ranking table, one
layout's breakdown, and a layout written as a train.py config."""

from __future__ import annotations

from meshtrain.physics.gpus import GIB, HEADROOM, usable_bytes
from meshtrain.parallel.layout import ParallelDims
from meshtrain.planning.shape import Job, forwards_per_step


def describe(lay: ParallelDims) -> str:
    pipe = f"pp {lay.pp} {lay.pp_schedule} x {lay.pp_microbatches} micro-batches, " if lay.pp > 1 else ""
    cp = f"cp {lay.cp}, " if lay.cp > 1 else ""
    ep = f" (ep {lay.ep})" if lay.ep > 1 else ""
    once = ", gradients reduced once a step" if lay.pp == 1 and lay.reduces_once else ""
    return (f"tp {lay.tp}, {cp}{pipe}dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}{ep}, "
            f"{lay.strategy}, AC {lay.ac}, micro-batch {lay.micro_batch}{once}")


def format_table(estimates: list) -> str:
    cp = any(e.layout.cp > 1 for e in estimates)  # a cp column only where cp was tried
    ep = any(e.layout.ep > 1 for e in estimates)  # an ep column only for a mixture of experts
    # "sync": when accumulated gradients are reduced (parallel/vocabulary.py GRADIENT_SYNC);
    # a column only where a layout reducing once a step without a pipeline is listed.
    sync = any(e.layout.pp == 1 and e.layout.reduces_once for e in estimates)
    head = ("#", "tp", *(("cp",) if cp else ()), "pp", "dp_rep", "dp_shard", *(("ep",) if ep else ()), "strategy",
            "AC", "mbs", *(("sync",) if sync else ()), "schedule", "pp_mb", "GiB/GPU", "step s", "tok/s/GPU", "MFU")
    rows = [head]
    for i, e in enumerate(estimates, 1):
        lay = e.layout
        rows.append((str(i), str(lay.tp), *((str(lay.cp),) if cp else ()), str(lay.pp), str(lay.dp_replicate),
                     str(lay.dp_shard), *((str(lay.ep),) if ep else ()), lay.strategy, lay.ac, str(lay.micro_batch),
                     *(("step" if lay.reduces_once else "microbatch",) if sync else ()),
                     lay.pp_schedule if lay.pp > 1 else "-", str(lay.pp_microbatches) if lay.pp > 1 else "-",
                     f"{e.memory.total / GIB:.1f}", f"{e.step_time:.2f}",
                     f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    left = {head.index(name) for name in ("strategy", "AC", "sync", "schedule") if name in head}  # text columns
    return "\n".join("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in
                               enumerate(zip(r, widths))).rstrip() for r in rows)


def format_breakdown(e, gpu, title: str = "Best") -> str:
    """One layout's estimate: memory by category, traffic, step time by part."""
    m = e.memory
    where = f" (pipeline rank {m.pp_rank}, the fullest)" if e.layout.pp > 1 else ""
    lines = [f"{title}: {describe(e.layout)}", f"  memory per GPU{where}, GiB:"]
    for name in ("params", "grads", "optimizer", "activations", "transient"):
        lines.append(f"    {name:<12}{getattr(m, name) / GIB:8.2f}")
    verdict = "fits in" if m.total <= usable_bytes(gpu) else "does NOT fit in"
    lines.append(f"    {'total':<12}{m.total / GIB:8.2f}   {verdict} {usable_bytes(gpu) / GIB:.0f} usable of "
                 f"{gpu.hbm_bytes / GIB:.0f} ({HEADROOM:.0%} headroom)")
    if e.layout.ep > 1:
        lines.append(f"  routing imbalance assumed: the busiest ep rank receives {e.moe_imbalance:.2f} x the mean "
                     f"token copies (its experts' compute, all-to-all time and activations; bytes are the mean)")
    lines.append("  sent per GPU per step, GB:  " + "  ".join(
        f"{dim} {b / 1e9:.1f}" for dim, b in e.comm_bytes.items()))
    lines.append("  step time, s:  " + "  ".join(f"{k} {v:.2f}" for k, v in e.times.items())
                 + f"  = {e.step_time:.2f}")
    lines.append("  compute, s:  " + "  ".join(f"{k} {v:.2f}" for k, v in e.compute_split.items())
                 + "  (matmuls, flash attention, memory-bound element-wise work: planning/kernels.py)")
    lines.append(f"  FSDP collectives take {e.fsdp_comm_time:.2f} s, {e.fsdp_comm_time / e.times['compute']:.0%} "
                 f"of the compute they are assumed to hide behind")
    lines += [f"  WARNING: {w}" for w in e.warnings]
    return "\n".join(lines)


MOE_KEYS = ("n_experts", "top_k", "n_dense_layers")  # [moe]'s keys a planned shape may carry


def custom_layers(m) -> list[str]:
    """[model] n_layers when the planned model's differs from its flavor's."""
    from meshtrain.models import registry

    flavor = registry.get(m.family).flavors.get(m.flavor)
    return [f"n_layers = {m.n_layers}"] if flavor is not None and flavor.n_layers != m.n_layers else []


def to_toml(e, job: Job, name: str, command: str) -> str:
    """The layout as a config for train.py (same shape as configs/llama70b_2d.toml)."""
    lay, m = e.layout, job.model
    local = lay.local_batch
    pipe = [f'pp_schedule = "{lay.pp_schedule}"', f"pp_microbatches = {lay.pp_microbatches if lay.pp > 1 else 0}"]
    if lay.pp > 1 and lay.stages_per_rank > 1:
        pipe.append(f"pp_stages_per_rank = {lay.stages_per_rank}")
    if lay.pp == 1:
        pipe = [p + "    # unused without a pipeline" for p in pipe]
    return "\n".join([
        f"# Planned by: {command}",
        f"# Estimate (formulas, not a measurement; see docs/planning.md): "
        f"{e.memory.total / GIB:.1f} GiB per GPU of {job.gpu.hbm_bytes / GIB:.0f},",
        f"# {e.step_time:.2f} s per step, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {e.mfu:.1%} "
        f"on {job.nodes} x {job.gpus_per_node} {job.gpu.name}.",
        *([f"# Planned with TP inside the matmuls (--tp-overlap {job.tp_overlap}): train.py runs that only under",
           "# [compile] enable = true and async_tp = true (CUDA), which this file does not set."]
          if job.tp_overlap and lay.tp > 1 else []),
        f"# Measure the memory: meshtrain dry-run --config {name}.toml --world-size {job.world}",
        f"# Launch on each of {job.nodes} node(s):",
        f"#   torchrun --nnodes={job.nodes} --nproc-per-node={job.gpus_per_node} --rdzv-backend=c10d \\",
        f"#            --rdzv-endpoint=HOST:29500 train.py --config {name}.toml",
        "",
        "[job]", f'name = "{name}"', 'output_dir = "outputs"',
        f'description = "{m.family} {m.flavor}: {describe(lay)}"', 'device = "cuda"', "",
        "[model]", f'name = "{m.family}"', f'flavor = "{m.flavor}"', f"vocab_size = {m.vocab}",
        *[f"{k} = {v}" for k, v in m.dims if k not in MOE_KEYS], *custom_layers(m), "",
        *(["[moe]", *[f"{k} = {v}" for k, v in m.dims if k in MOE_KEYS], ""]
          if any(k in MOE_KEYS for k, _ in m.dims) else []),
        "[training]", f"global_batch_size = {job.global_batch}",
        f"local_batch_size = {local}" + ("" if lay.pp > 1 else
                                          f"      # {forwards_per_step(job, lay)} accumulation step(s)"),
        f"seq_len = {job.seq_len}", 'mixed_precision_param = "bfloat16"',
        f'mixed_precision_reduce = "{job.reduce_dtype}"', *(["chunked_loss = true"] if job.chunked_loss else []), "",
        "[parallelism]", f"dp_replicate = {lay.dp_replicate}", f"dp_shard = {lay.dp_shard}",
        f"tp = {lay.tp}", f"pp = {lay.pp}", *([f"cp = {lay.cp}"] if lay.cp > 1 else []),
        *([f"ep = {lay.ep}"] if lay.ep > 1 else []), *pipe,
        f'sharding_strategy = "{lay.strategy}"',
        *(['gradient_sync = "step"      # reduced once, after the last accumulation micro-batch']
          if lay.pp == 1 and lay.reduces_once else []),
        "sequence_parallel = true", "loss_parallel = true", "",
        "[activation_checkpoint]", f'mode = "{lay.ac}"', "selective_every = 2", "",
        *(["[compile]", "enable = true", "loss = true", ""] if job.compiled else []),
        *(["[optimizer]", 'name = "Muon"', f"ns_steps = {job.ns_steps}", ""] if job.muon_shapes else [])])
