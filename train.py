"""Train a Llama with FSDP2 x tensor parallelism from a TOML config.

    torchrun --nproc-per-node 4 train.py --config debug_2d              # CPU, dp 2 x tp 2
    torchrun --nproc-per-node 8 train.py --config llama70b_2d           # one node of a cluster
    python train.py --config debug_2d --parallelism.tp 1 --parallelism.dp_shard 1   # one process

Read top to bottom: config -> layout -> model on meta -> parallelize -> init -> data,
optimizer, metrics -> the loop. Everything that can be wrong with the config is checked
before the process group starts, so a bad config costs a second, not a cluster allocation.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from models.llama import Llama
from parallel import LayoutError, ParallelDims, mesh_coordinate, mixed_precision_policy, parallelize, submesh
from training.config import ConfigError, JobConfig, config_to_toml, parse_args
from training.data import build_dataloader, build_tokenizer
from training.metrics import MetricsLogger, device_peak_flops, flops_per_token, memory_stats
from training.optim import build_lr_scheduler, build_optimizer
from training.step import train_step

# Embedding rows are padded to a multiple of this when the vocabulary comes from the
# tokenizer (258 for bytes), so any TP degree up to 64 divides it.
VOCAB_MULTIPLE = 64


def build_parallel_dims(cfg: JobConfig, world_size: int | None = None) -> ParallelDims:
    p = cfg.parallelism
    if p.pp > 1:
        raise ConfigError("[parallelism] pp > 1: pipeline parallelism is not available yet; set pp = 1")
    return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp,
                        world_size=world_size)


def build_model(cfg: JobConfig, tokenizer_vocab: int) -> Llama:
    vocab = cfg.model.vocab_size or -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab < tokenizer_vocab:
        raise ConfigError(f"[model] vocab_size = {vocab} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer_vocab})")
    return Llama.from_flavor(cfg.model.flavor, meta=True, vocab_size=vocab, norm_eps=cfg.model.norm_eps,
                             max_seq_len=max(cfg.training.seq_len, 1))


def check_layout(cfg: JobConfig, dims: ParallelDims, model: Llama) -> None:
    """Everything about the layout that can be known before any process group exists."""
    t, p = cfg.training, cfg.parallelism
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if resolve_device(cfg) == "cuda" else None
    dims.check_model(model.tp_divisible(), seq_len=t.seq_len, sequence_parallel=p.sequence_parallel,
                     gpus_per_node=gpus_per_node)
    local = t.local_batch_size or t.global_batch_size // dims.dp
    if t.global_batch_size % (dims.dp * local) or local < 1:
        raise LayoutError(
            f"[training] global_batch_size = {t.global_batch_size} must be a multiple of "
            f"dp * local_batch_size = {dims.dp_replicate}*{dims.dp_shard} * {local} = {dims.dp * local} "
            f"(dp = dp_replicate*dp_shard)")
    if cfg.checkpoint.enable:
        raise ConfigError("[checkpoint] enable = true: checkpoint saving is not available yet; "
                          "set enable = false")


def parallelize_model(model: Llama, mesh, cfg: JobConfig) -> Llama:
    p, t = cfg.parallelism, cfg.training
    mixed = None
    if (t.mixed_precision_param, t.mixed_precision_reduce) != ("float32", "float32"):
        mixed = mixed_precision_policy(t.mixed_precision_param, t.mixed_precision_reduce)
    return parallelize(model, mesh, sharding_strategy=p.sharding_strategy, mixed_precision=mixed,
                       cpu_offload=p.cpu_offload, sequence_parallel=p.sequence_parallel,
                       loss_parallel=p.loss_parallel,
                       activation_checkpoint=cfg.activation_checkpoint.mode,
                       ac_every=cfg.activation_checkpoint.selective_every, compile=cfg.compile.enable)


def resolve_device(cfg: JobConfig) -> str:
    if cfg.job.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.job.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError('[job] device = "cuda" but no CUDA device is visible; use "auto" or "cpu"')
    return cfg.job.device


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    if args.print_config:
        print(config_to_toml(cfg), end="")
        return
    device_type = resolve_device(cfg)
    tokenizer = build_tokenizer(cfg.training.tokenizer)
    dims = build_parallel_dims(cfg)
    model = build_model(cfg, tokenizer.vocab_size)
    check_layout(cfg, dims, model)

    mesh = dims.build_mesh(device_type)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    rank = dist.get_rank()
    model = parallelize_model(model, mesh, cfg)
    model.init_weights(seed=cfg.training.seed, device=device)

    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    data, _ = build_dataloader(cfg.training, dp_rank=dp_rank, dp_size=dp_size)
    o, s = cfg.optimizer, cfg.lr_scheduler
    optimizer = build_optimizer(model, lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                                weight_decay=o.weight_decay)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=s.warmup_steps, total_steps=cfg.training.steps,
                                   decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio, decay_ratio=s.decay_ratio)
    run_dir = Path(cfg.job.output_dir) / cfg.job.name
    metrics = MetricsLogger(run_dir / "tb", rank=rank, log_freq=cfg.metrics.log_freq,
                            enable_tensorboard=cfg.metrics.enable_tensorboard, config_text=config_to_toml(cfg))

    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
    num_embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    flops = flops_per_token(num_params, num_embedding, model.cfg.n_layers, model.cfg.dim, cfg.training.seq_len)
    peak = device_peak_flops(device)
    tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
    use_loss_parallel = submesh(mesh, "tp") is not None and cfg.parallelism.loss_parallel
    dp_mesh = submesh(mesh, "dp")
    if rank == 0:
        print(f"meshtrain: {mesh} | {num_params / 1e6:,.1f}M parameters | "
              f"{data.grad_accum_steps} micro-batch(es) per step | logs in {run_dir}", flush=True)

    for step in range(1, cfg.training.steps + 1):
        start = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(model, optimizer, data.batch(step - 1), max_norm=cfg.training.max_norm,
                                     loss_parallel=use_loss_parallel, dp_mesh=dp_mesh, device=device)
        scheduler.step()
        if metrics.should_log(step):
            # Per device, the convention published throughput numbers use.
            tps = tokens_per_step / (time.perf_counter() - start) / dist.get_world_size()
            scalars = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_second": tps}
            if peak:
                scalars["mfu"] = 100 * tps * flops / peak
            scalars.update(memory_stats(device))
            metrics.log(step, scalars)
    metrics.close()
    dist.destroy_process_group()


def run(argv: list[str] | None = None) -> int:
    """Bad input ends every rank promptly with a message and exit code 2, not a traceback
    (``--debug`` shows it). Only rank 0 prints: every rank read the same config."""
    debug = "--debug" in (argv if argv is not None else sys.argv)
    try:
        main(argv)
        return 0
    except (ConfigError, LayoutError, ValueError, FileNotFoundError) as err:
        if debug:
            traceback.print_exc()
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"meshtrain: error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(run())
