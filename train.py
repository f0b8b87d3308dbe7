"""Train a Llama or GPT-2 with FSDP2 x tensor parallelism x pipeline parallelism from a TOML config.

    torchrun --nproc-per-node 4 train.py --config debug_2d              # CPU, dp 2 x tp 2
    torchrun --nproc-per-node 8 train.py --config debug_3d              # CPU, pp 2 x dp 2 x tp 2
    torchrun --nproc-per-node 8 train.py --config llama70b_2d           # one node of a cluster
    python train.py --config debug_2d --parallelism.tp 1 --parallelism.dp_shard 1   # one process

Read top to bottom: config -> layout -> model on meta -> [cut into pipeline stages] ->
parallelize each part -> init -> data, optimizer, metrics -> the loop. Everything that can be wrong with the config is checked
before the process group starts, so a bad config costs a second, not a cluster allocation.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from models.gpt2 import FLAVORS as GPT2_FLAVORS
from models.gpt2 import GPT2
from models.llama import Llama
from parallel import (LayoutError, ParallelDims, mesh_coordinate, mixed_precision_policy, parallelize,
                      shutdown_distributed, submesh)
from parallel.async_tp import async_tp_unavailable
from parallel.float8 import apply_float8, float8_unavailable
from parallel.pipeline import SCHEDULES, build_schedule, check_pipeline, default_stages_per_rank, split_into_stages
from parallel.tied import tie_across_stages
from training.checkpoint import CheckpointError, CheckpointManager
from training.config import ConfigError, JobConfig, config_to_toml, parse_args
from training.data import build_dataloader, build_tokenizer
from training.faults import (CollectiveFailure, GracefulStop, NonFiniteError, describe_collective_failure,
                             is_collective_failure, set_collective_timeout, step_phase)
from training.metrics import MetricsLogger, device_peak_flops, flops_per_token, memory_stats
from training.optim import Optimizers, Schedulers
from training.step import compile_loss, pipeline_loss_fn, pipeline_train_step, train_step

# Embedding rows are padded to a multiple of this when the vocabulary comes from the
# tokenizer (258 for bytes), so any TP degree up to 64 divides it.
VOCAB_MULTIPLE = 64


def build_parallel_dims(cfg: JobConfig, world_size: int | None = None) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp,
                        world_size=world_size)


def build_model(cfg: JobConfig, tokenizer_vocab: int) -> nn.Module:
    """The whole model on meta: no memory, whatever its size."""
    m, seq_len = cfg.model, cfg.training.seq_len
    vocab = m.vocab_size or -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    layers = {"n_layers": m.n_layers} if m.n_layers else {}
    if vocab < tokenizer_vocab:
        raise ConfigError(f"[model] vocab_size = {vocab} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer_vocab})")
    if m.name == "gpt2":
        # Learned positions: the flavor's table size is part of the model, not the run.
        rows = GPT2_FLAVORS[m.flavor].max_seq_len
        if seq_len > rows:
            raise ConfigError(f"[training] seq_len = {seq_len} is longer than GPT-2 {m.flavor}'s {rows} "
                              f"learned positions; use seq_len <= {rows}")
        return GPT2.from_flavor(m.flavor, meta=True, vocab_size=vocab, norm_eps=m.norm_eps, **layers)
    # Rotary tables are computed, not learned: size them for this run.
    return Llama.from_flavor(m.flavor, meta=True, vocab_size=vocab, norm_eps=m.norm_eps, max_seq_len=seq_len,
                             **layers)


def check_layout(cfg: JobConfig, dims: ParallelDims, model: nn.Module) -> list[list[int]] | None:
    """Everything about the layout that can be known before any process group exists.
    Returns the layers of each pipeline stage (None without a pipeline)."""
    t, p = cfg.training, cfg.parallelism
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if resolve_device(cfg) == "cuda" else None
    dims.check_model(model.tp_divisible(), seq_len=t.seq_len, sequence_parallel=p.sequence_parallel,
                     gpus_per_node=gpus_per_node)
    local = t.local_batch_size or t.global_batch_size // dims.dp
    if local < 1 or t.global_batch_size % (dims.dp * local):  # local is 0 when global < dp
        per_step = (f"dp * local_batch_size = {dims.dp_replicate}*{dims.dp_shard} * {local} = {dims.dp * local}"
                    if t.local_batch_size else f"dp = {dims.dp_replicate}*{dims.dp_shard} = {dims.dp}")
        raise LayoutError(f"[training] global_batch_size = {t.global_batch_size} must be a multiple of "
                          f"{per_step} (dp = dp_replicate*dp_shard)")
    if t.dataset == "text" and not (t.dataset_path and os.path.exists(t.dataset_path)):
        raise ConfigError(f'[training] dataset = "text" needs dataset_path = a file or folder of text; '
                          f'"{t.dataset_path}" does not exist')
    hf = cfg.checkpoint.initial_load_hf
    if hf and cfg.model.name != "llama":
        raise ConfigError(f'[checkpoint] initial_load_hf reads Hugging Face Llama weights; [model] name = '
                          f'"{cfg.model.name}" has no importer')
    if hf and not os.path.isfile(Path(hf) / "config.json"):  # False, not OSError, for too long a name
        raise ConfigError(f"[checkpoint] initial_load_hf = \"{hf}\": no Hugging Face config.json there "
                          f"(expected a folder with config.json and *.safetensors)")
    if dims.pp == 1:
        return None
    try:
        return check_pipeline(pp=dims.pp, n_layers=model.cfg.n_layers, schedule=p.pp_schedule,
                              stages_per_rank=stages_per_rank(cfg), n_microbatches=pp_microbatches(cfg),
                              local_batch=local, layers_per_stage=p.pp_layers_per_stage,
                              split_points=p.pp_split_points)
    except LayoutError as err:
        raise LayoutError(f"[parallelism] pp = {dims.pp}, pp_schedule = \"{p.pp_schedule}\": {err}") from None


def stages_per_rank(cfg: JobConfig) -> int:
    p = cfg.parallelism
    return p.pp_stages_per_rank or default_stages_per_rank(p.pp_schedule)


def pp_microbatches(cfg: JobConfig) -> int:
    """Default: one per stage, the fewest that keep every stage of the pipeline busy."""
    p = cfg.parallelism
    return p.pp_microbatches or p.pp * stages_per_rank(cfg)


def check_speed_options(cfg: JobConfig, dims: ParallelDims) -> None:
    """[compile] async_tp and [float8] need hardware and packages a machine may lack: say
    which, before any process group starts."""
    device_type = resolve_device(cfg)
    if cfg.compile.async_tp:
        reason = async_tp_unavailable(device_type, compile=cfg.compile.enable, tp=dims.tp)
        if reason:
            raise ConfigError(f"[compile] async_tp = true cannot run here: {reason}")
    if cfg.float8.enable:
        reason = float8_unavailable(device_type, tp=dims.tp)
        if reason:
            raise ConfigError(f"[float8] enable = true cannot run here: {reason}")


def parallelize_model(model: nn.Module, mesh, cfg: JobConfig) -> nn.Module:
    p, t = cfg.parallelism, cfg.training
    mixed = None
    if (t.mixed_precision_param, t.mixed_precision_reduce) != ("float32", "float32"):
        mixed = mixed_precision_policy(t.mixed_precision_param, t.mixed_precision_reduce)
    if cfg.float8.enable:  # first: FSDP then shards the float8 layers' weights as usual
        apply_float8(model)  # every Linear but the output head
    return parallelize(model, mesh, sharding_strategy=p.sharding_strategy, mixed_precision=mixed,
                       cpu_offload=p.cpu_offload, sequence_parallel=p.sequence_parallel,
                       loss_parallel=p.loss_parallel,
                       activation_checkpoint=cfg.activation_checkpoint.mode,
                       ac_every=cfg.activation_checkpoint.selective_every, compile=cfg.compile.enable,
                       async_tp=cfg.compile.async_tp)


def resolve_device(cfg: JobConfig) -> str:
    if cfg.job.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.job.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError('[job] device = "cuda" but no CUDA device is visible; use "auto" or "cpu"')
    return cfg.job.device


def main(argv: list[str] | None = None) -> None:
    # Set before the first CUDA allocation: the caching allocator grows segments in place
    # instead of keeping differently sized blocks apart, which otherwise reserves GiBs
    # more than a step ever allocates (measured on an H100: 11 GiB over 43).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg, args = parse_args(argv)
    if args.print_config:
        print(config_to_toml(cfg), end="")
        return
    if args.dry_run:
        from training.dry_run import dry_run

        report = dry_run(cfg, args.world_size or int(os.environ.get("WORLD_SIZE", 1)), args.rank,
                         args.gpus_per_node, gpu=args.gpu)
        if report.get("fits") is False:
            raise SystemExit(1)
        return
    device_type = resolve_device(cfg)
    tokenizer = build_tokenizer(cfg.training.tokenizer)
    dims = build_parallel_dims(cfg)
    model = build_model(cfg, tokenizer.vocab_size)
    stage_layers = check_layout(cfg, dims, model)
    check_speed_options(cfg, dims)

    mesh = dims.build_mesh(device_type, timeout_seconds=cfg.comm.init_timeout_seconds)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    rank = dist.get_rank()
    num_params = sum(p.numel() for p in model.parameters())  # the whole model, still on meta
    num_embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    # A tied embedding is also the output matmul: its FLOPs count (N counts it once).
    num_embedding -= sum(model.get_parameter(names[0]).numel() for names in model.tied_weights())
    pp_mesh = submesh(mesh, "pp")
    # Under a pipeline this rank keeps only its stages (cut from the meta model: nothing
    # else is ever allocated); each is parallelized over the rest of the mesh.
    parts = [(0, model)] if pp_mesh is None else split_into_stages(
        model, pp_mesh, stage_layers, style=SCHEDULES[cfg.parallelism.pp_schedule][1])
    model_parts = [parallelize_model(part, mesh, cfg) for _, part in parts]
    compile_loss(cfg.compile.loss)  # process-wide: every train step's cross-entropy
    for part in model_parts:
        part.init_weights(seed=cfg.training.seed, device=device)
    # A weight tied across stages (GPT-2's embedding and output) has a copy on each end.
    tied = tie_across_stages(model_parts, mesh, pp_mesh, model.tied_weights()) if pp_mesh is not None else None

    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    data, _ = build_dataloader(cfg.training, dp_rank=dp_rank, dp_size=dp_size)
    o, s = cfg.optimizer, cfg.lr_scheduler
    optimizer = Optimizers(model_parts, lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                           weight_decay=o.weight_decay)
    scheduler = Schedulers(optimizer, warmup_steps=s.warmup_steps, total_steps=cfg.training.steps,
                           decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio, decay_ratio=s.decay_ratio)
    run_dir = Path(cfg.job.output_dir) / cfg.job.name

    start_step, checkpoint = 0, None
    if cfg.checkpoint.enable:
        c = cfg.checkpoint
        checkpoint = CheckpointManager(run_dir / c.folder, parts=model_parts, optimizers=optimizer,
                                       schedulers=scheduler, model_config=model.cfg,
                                       job_config_text=config_to_toml(cfg), interval=c.interval,
                                       keep_latest_k=c.keep_latest_k, async_save=c.async_save,
                                       last_save_model_only=c.last_save_model_only,
                                       export_dtype=getattr(torch, c.export_dtype),
                                       if_config_differs=c.if_config_differs, tied=model.tied_weights())
        start_step, data_state = checkpoint.resume(c.load_step)
        if data_state:
            data.load_state_dict(data_state)  # refuses a different dataset / seq_len / batch
    if start_step == 0 and cfg.checkpoint.initial_load_hf:
        from models.llama.hf import load_hf_weights_

        for part in model_parts:  # each rank reads only its own shards of each tensor
            try:
                load_hf_weights_(part, cfg.checkpoint.initial_load_hf)
            except (ValueError, FileNotFoundError) as err:  # the folder does not fit the model
                raise CheckpointError(f"[checkpoint] initial_load_hf: {err}") from None
    metrics = MetricsLogger(run_dir / "tb", rank=rank, log_freq=cfg.metrics.log_freq,
                            enable_tensorboard=cfg.metrics.enable_tensorboard, config_text=config_to_toml(cfg),
                            purge_step=start_step + 1 if start_step else None)

    flops = flops_per_token(num_params, num_embedding, model.cfg.n_layers, model.cfg.dim, cfg.training.seq_len)
    peak = device_peak_flops(device)
    tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
    use_loss_parallel = submesh(mesh, "tp") is not None and cfg.parallelism.loss_parallel
    dp_mesh = submesh(mesh, "dp")
    schedule = None
    if pp_mesh is not None:
        ids = [i for i, _ in parts]
        first, last = 0 in ids, len(stage_layers) - 1 in ids  # feeds tokens / computes the loss
        n_micro = pp_microbatches(cfg)
        schedule = build_schedule(cfg.parallelism.pp_schedule, list(zip(ids, model_parts)),
                                  pp_mesh, n_microbatches=n_micro, n_stages=len(stage_layers), device=device,
                                  loss_fn=pipeline_loss_fn(n_micro * data.grad_accum_steps))
    if rank == 0:
        pipeline = "" if pp_mesh is None else (
            f" | {cfg.parallelism.pp_schedule}: {len(stage_layers)} stages of "
            f"{'/'.join(str(len(s)) for s in stage_layers)} layers, {n_micro} micro-batches")
        resumed = f" | resumed at step {start_step}" if start_step else ""
        print(f"meshtrain: {mesh} | {num_params / 1e6:,.1f}M parameters | "
              f"{data.grad_accum_steps} micro-batch(es) per step{pipeline}{resumed} | logs in {run_dir}", flush=True)

    stop, skipped, t = GracefulStop(), 0, cfg.training
    try:
        for step in range(start_step + 1, t.steps + 1):
            start = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            batch = data.batch(step - 1)
            if schedule is None:
                loss, grad_norm = train_step(model_parts[0], optimizer, batch, max_norm=t.max_norm,
                                             loss_parallel=use_loss_parallel, dp_mesh=dp_mesh, device=device,
                                             step=step, skip_nonfinite=True)
            else:
                loss, grad_norm = pipeline_train_step(schedule, model_parts, optimizer, batch, first=first,
                                                      last=last, max_norm=t.max_norm,
                                                      loss_parallel=use_loss_parallel, dp_mesh=dp_mesh,
                                                      pp_mesh=pp_mesh, device=device, step=step,
                                                      skip_nonfinite=True, tied=tied)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the weights were left alone
                skipped += 1
                if t.nonfinite == "stop" or skipped > t.max_skipped_steps:
                    stop_on_nonfinite(step, loss, grad_norm, skipped, checkpoint, data, t)
                if rank == 0:
                    print(f"meshtrain: warning: step {step}: loss {loss}, grad_norm {grad_norm}; step skipped "
                          f"({skipped} of at most {t.max_skipped_steps})", file=sys.stderr, flush=True)
            scheduler.step()
            if step == start_step + 1:  # start-up is over: from now on a long wait means a dead rank
                set_collective_timeout(cfg.comm.train_timeout_seconds)
            if metrics.should_log(step):
                # Per device, the convention published throughput numbers use.
                tps = tokens_per_step / (time.perf_counter() - start) / dist.get_world_size()
                scalars = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_second": tps}
                if peak:
                    scalars["mfu"] = 100 * tps * flops / peak
                scalars.update(memory_stats(device))
                metrics.log(step, scalars)
            stopping = stop.agreed(device)  # every rank stops after the same step
            if checkpoint is not None and (stopping or checkpoint.should_save(step, last=step == t.steps)):
                with step_phase(step, "checkpoint save"):
                    checkpoint.save(step, data_state=data.state_dict(), last=step == t.steps)
            if stopping:
                if rank == 0:
                    saved = "checkpoint saved; run the same command to resume" if checkpoint else \
                        "checkpointing is off, so a rerun starts over"
                    print(f"meshtrain: {stopping} received: stopped after step {step}; {saved}", flush=True)
                break
    except RuntimeError as err:
        if is_collective_failure(err):
            raise CollectiveFailure(describe_collective_failure(err, cfg.comm.train_timeout_seconds)) from err
        raise
    finally:
        stop.restore()
    if checkpoint is not None:
        checkpoint.close()
    metrics.close()
    shutdown_distributed()


def stop_on_nonfinite(step, loss, grad_norm, skipped, checkpoint, data, t) -> None:
    """The weights are still those after step - 1: keep them, then stop."""
    saved = ""
    if checkpoint is not None and step > 1:
        checkpoint.save(step - 1, data_state=data.state_dict())
        checkpoint.close()
        saved = f" The last good state is checkpointed as step {step - 1}."
    why = "[training] nonfinite = \"stop\"" if t.nonfinite == "stop" else \
        f"{skipped} steps skipped, more than [training] max_skipped_steps = {t.max_skipped_steps}"
    raise NonFiniteError(f"step {step}: loss {loss}, grad_norm {grad_norm} ({why}).{saved} Lower the learning "
                         f"rate, check the data, or set nonfinite = \"skip\".")


def run(argv: list[str] | None = None) -> int:
    """Bad input ends every rank promptly with a message and exit code 2, not a traceback
    (``--debug`` shows it). Only rank 0 prints: every rank read the same config. Bad input
    means meshtrain's own error types, raised where the input is checked; any other
    exception is a bug and keeps its traceback (exit 1)."""
    debug = "--debug" in (argv if argv is not None else sys.argv)
    try:
        main(argv)
        return 0
    except (ConfigError, LayoutError, CheckpointError) as err:
        if debug:
            traceback.print_exc()
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"meshtrain: error: {err}", file=sys.stderr, flush=True)
        return 2
    except (CollectiveFailure, NonFiniteError) as err:
        # Every rank that sees it says so: the rank that names the failure may not be rank 0.
        if debug:
            traceback.print_exc()
        print(f"meshtrain: error: {err}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(run())
