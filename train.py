"""Train a model from a TOML config with FSDP2 x tensor parallelism x pipeline parallelism.

    meshtrain train --config debug_2d --nproc-per-node 4               # CPU, dp 2 x tp 2
    torchrun --nproc-per-node 4 train.py --config debug_2d              # the same, from a checkout
    torchrun --nproc-per-node 8 -m meshtrain.train --config llama70b_2d # one node of a cluster
    python train.py --config debug_2d --parallelism.tp 1 --parallelism.dp_shard 1   # one process

Read top to bottom: config -> model on meta -> layout (every rule checked before any
process group, so a bad config costs a second, not a cluster allocation) -> mesh ->
this rank's parts, parallelized -> weights -> data, validation, optimizer, checkpoint,
metrics -> the loop. How each piece is built is training/recipe.py, shared with the dry run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

from meshtrain.training import startup_signals
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import config_to_dict, config_to_toml, parse_args


def main(argv: list[str] | None = None) -> None:
    # Set before the first CUDA allocation: the caching allocator grows segments in place
    # instead of keeping differently sized blocks apart, which otherwise reserves GiBs
    # more than a step ever allocates (measured on an H100: 11 GiB over 43).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg, args = parse_args(argv)  # the whole config, checked before torch is even imported
    if args.print_config:
        print(config_to_toml(cfg), end="")
        return
    if args.dry_run or args.check_collectives:  # fake tensors on a fake world: nothing launches
        startup_signals.end_at_once()  # nothing to unwind: a signal ends the process where it is
        from meshtrain.planning.collective_check import check_collectives_later
        from meshtrain.planning.dry_run import dry_run

        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
        report, hangs = {}, []
        # Both asked: the hang check starts first, in a forked process when a core is free for
        # it, and traces its ranks while this process traces the dry run's rank.
        with check_collectives_later(cfg, world_size, args.gpus_per_node, jobs=args.jobs,
                                     beside=args.dry_run and args.check_collectives) as check:
            if args.dry_run:
                report = dry_run(cfg, world_size, args.rank, args.gpus_per_node, gpu=args.gpu)
            if args.check_collectives:
                hangs = check()
        if report.get("fits") is False or hangs:
            raise SystemExit(1)
        return
    if int(os.environ.get("RANK", 0)) == 0:  # importing torch alone takes seconds on a busy node
        print(f"meshtrain: {cfg.job.name}: config checked; starting (torch, process group, model) ...", flush=True)
    import torch
    import torch.distributed as dist

    from meshtrain.parallel import shutdown_distributed
    from meshtrain.training import hang_report, recipe
    from meshtrain.training.console import announce, say_done, say_nothing_to_do, say_stopped
    from meshtrain.training.data import build_dataloader, build_tokenizer
    from meshtrain.training.evaluate import build_validation
    from meshtrain.training.fault_tolerance import open_fault_tolerance
    from meshtrain.training.faults import (CollectiveFailure, GracefulStop, describe_collective_failure,
                                 is_collective_failure, set_collective_timeout, skip_or_stop, step_phase)
    from meshtrain.training.metrics import (MetricsLogger, device_peak_flops, memory_stats, model_flops_per_token,
                                  set_aside_earlier_run)
    from meshtrain.training.profiling import Profiler

    t = cfg.training
    torch.manual_seed(t.seed)  # torch's own generators too (every rank alike): a rerun repeats bitwise
    tokenizer = build_tokenizer(t.tokenizer)
    model = recipe.build_model(cfg, tokenizer.vocab_size)    # the whole model, on meta
    layout = recipe.plan_layout(cfg, model)                  # every check, before any process group
    mesh = layout.build_mesh(recipe.device_type(cfg), timeout_seconds=cfg.comm.init_timeout_seconds)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    run_dir = recipe.run_folder(cfg)                         # under [fault_tolerance], one per replica group
    recipe.claim_run_dir(run_dir)                            # one run per folder
    flops, n_params = model_flops_per_token(model, t.seq_len), sum(p.numel() for p in model.parameters())
    parts = recipe.build_parts(cfg, layout, mesh, model)     # this rank's stages: TP, AC, compile, FSDP
    for part in parts.modules:
        part.init_weights(seed=t.seed, device=device)        # each rank fills only its shards

    dp_rank, dp_size = recipe.data_shard(cfg, mesh)          # under [fault_tolerance], of every replica group
    data, _ = build_dataloader(t, dp_rank=dp_rank, dp_size=dp_size, held_out=cfg.validation.split)
    validation = build_validation(cfg, layout, parts, device)  # None unless [validation] enable
    optimizer, scheduler = recipe.build_optimizer(cfg, parts.modules)
    checkpoint, start_step = recipe.open_checkpoint(cfg, parts, optimizer, scheduler, data, run_dir)
    if start_step >= t.steps:
        say_nothing_to_do(start_step, t.steps, checkpoint)
        checkpoint.close()
        shutdown_distributed()
        return
    if start_step == 0:
        recipe.load_initial_weights(cfg, parts)              # [checkpoint] initial_load_hf, [lora] initial_load_adapter
    hf_export = recipe.open_hf_export(cfg, parts, run_dir)  # None unless [checkpoint] export_hf_interval
    # Last before the loop: from here on the lighthouse counts this group in (a no-op without [fault_tolerance]).
    ft = open_fault_tolerance(cfg, parts.modules, optimizer, scheduler, start_step)
    step = recipe.build_step(cfg, layout, parts, optimizer, device, ft)
    if start_step == 0 and dist.get_rank() == 0:
        set_aside_earlier_run(run_dir / "tb")                # a new run gets its own TensorBoard curve
    metrics = MetricsLogger(run_dir / "tb", rank=dist.get_rank(), log_freq=cfg.metrics.log_freq,
                            enable_tensorboard=cfg.metrics.enable_tensorboard, trackers=cfg.metrics.trackers,
                            config=config_to_dict(cfg), config_text=config_to_toml(cfg),
                            purge_step=start_step + 1 if start_step else None, run_name=cfg.job.name)
    profiler = Profiler(cfg.profiling, run_dir, dist.get_rank(), device)  # [profiling]'s window, if enabled
    peak, tokens_per_step = device_peak_flops(device), recipe.group_batch(cfg) * t.seq_len
    announce(n_params, layout, layout.grad_accum(recipe.group_batch(cfg)), mesh, start_step, run_dir,
             trainable=sum(p.numel() for p in model.parameters() if p.requires_grad))

    stop, skipped, stopping, began = GracefulStop(), 0, None, time.perf_counter()
    n, loss, started = start_step, math.nan, False  # n and loss stay so if a rejoining group finds the run done
    hang = hang_report.watch(run_dir, mesh, cfg.comm.init_timeout_seconds)  # a stall explains itself in hang/
    try:
        for n in ft.steps(start_step + 1, t.steps):  # with [fault_tolerance], as the live replica groups agree
            with profiler.step(n):  # a no-op outside [profiling]'s window
                start, lr = time.perf_counter(), scheduler.get_last_lr()[0]
                loss, grad_norm = step(data.batch(n - 1), n)
                if not ft.committed():  # a replica group was lost during the step: the same step, by those left
                    continue
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the weights were left alone
                    skipped = skip_or_stop(n, loss, grad_norm, skipped, checkpoint, data, t)
                scheduler.step()
                if not started:  # start-up is over: from now on a long wait means a dead rank
                    set_collective_timeout(cfg.comm.train_timeout_seconds)
                    started = True  # (a replica group that rejoined began past start_step + 1)
                if metrics.should_log(n):
                    # Per device, the convention published throughput numbers use.
                    tps = tokens_per_step / (time.perf_counter() - start) / dist.get_world_size()
                    scalars = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_second": tps}
                    if peak:
                        scalars["mfu"] = 100 * tps * flops / peak
                    if ft.enabled:
                        scalars["replica_groups"] = ft.replica_groups()
                    metrics.log(n, {**scalars, **recipe.model_metrics(parts), **memory_stats(device)})
                if validation is not None and validation.due(n, last=n == t.steps):
                    metrics.log(n, validation.run(n))  # forward only, on held-out data: training is untouched
                if hf_export is not None and hf_export.due(n, last=n == t.steps):
                    with step_phase(n, "Hugging Face export"):
                        hf_export.export(n)  # gathered now; with async_save written in the background
                stopping = stop.agreed(device)  # every rank stops after the same step
                if checkpoint is not None and (stopping or checkpoint.should_save(n, last=n == t.steps)):
                    with step_phase(n, "checkpoint save"):
                        checkpoint.save(n, data_state=data.state_dict(), last=n == t.steps)
                if stopping:
                    say_stopped(stopping, n, checkpoint)
                    break
    except torch.OutOfMemoryError:
        where = profiler.out_of_memory()  # CUDA: the allocator's snapshot, written now
        if where:
            print(f"meshtrain: {where}", file=sys.stderr, flush=True)
        raise
    except RuntimeError as err:
        if is_collective_failure(err):
            ft.abandon()  # with [fault_tolerance]: the other replica groups go on without this one, now
            raise CollectiveFailure(describe_collective_failure(err, cfg.comm.train_timeout_seconds)) from err
        raise
    finally:
        stop.restore()  # the start-up handler again (run() installed it)
        hang.stop()
        startup_signals.training_over()
        profiler.close(n)
        ft.close()
    if checkpoint is not None:
        checkpoint.close()
    if hf_export is not None:
        hf_export.close()
    metrics.close()
    if not stopping:
        say_done(start_step, n, time.perf_counter() - began, tokens_per_step, loss, checkpoint, run_dir)
    shutdown_distributed()


def run(argv: list[str] | None = None, command=main) -> int:
    """``command(argv)``: the trainer, or `meshtrain evaluate` (cli.py). Bad input ends
    every rank promptly with a message and exit code 2, not a traceback (``--debug`` shows
    it). Only rank 0 prints: every rank read the same config. Bad input means meshtrain's
    own error types, raised where the input is checked; any other exception is a bug and
    keeps its traceback (exit 1). A failed collective or a non-finite step ends with 3,
    said by every rank that sees it."""
    debug = "--debug" in (argv if argv is not None else sys.argv)
    # First: SIGTERM may come while torch is still importing.
    previous = startup_signals.install(on_blocked=lambda stop: os._exit(say_stopped_at_start_up(stop)))
    try:
        command(argv)
        return 0
    except startup_signals.StoppedBySignal as stop:
        startup_signals.ending()
        if debug:
            traceback.print_exc()
        return say_stopped_at_start_up(stop)
    except Exception as err:
        startup_signals.ending()  # a bug keeps its traceback too, not the signal's
        code = exit_code(err)
        if code is None and "torch" in sys.modules:
            err, code = startup_collective_failure(err)
        if code is None:
            raise
        if debug:
            traceback.print_exc()
        # Under `meshtrain train --nproc-per-node`, the launcher says the first rank's message once.
        launched = os.environ.get("MESHTRAIN_LAUNCHER") == "1"
        # Most errors are seen alike by every rank; a damaged data file only by the rank reading it.
        if not launched and (code == 3 or getattr(err, "every_rank", False) or int(os.environ.get("RANK", 0)) == 0):
            print(f"meshtrain: error: {err}", file=sys.stderr, flush=True)
        tell_torchrun(f"meshtrain: error: {err}")
        return code
    finally:
        startup_signals.restore(previous)


def say_stopped_at_start_up(stop) -> int:
    """The one line of a rank stopped by a signal during start-up; its exit code."""
    if os.environ.get("MESHTRAIN_LAUNCHER") != "1":  # each rank got its own signal: each says so
        print(f"meshtrain: error: {stop}", file=sys.stderr, flush=True)
    tell_torchrun(f"meshtrain: error: {stop}")
    return 128 + stop.signum


def tell_torchrun(message: str) -> None:
    """torchrun ends a failed job with a report whose "Root Cause" shows each failed rank's
    error file, or else a link about tracebacks; give it our one-line message instead."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        with open(path, "w") as fh:
            json.dump({"message": message, "timestamp": int(time.time())}, fh)


def startup_collective_failure(err: Exception) -> tuple[Exception, int | None]:
    """A collective of start-up (the run lock's broadcast, building the model's shards,
    resuming) that failed because another rank is gone -- stopped or killed while starting
    -- as the one line a failure during training gets (main), exit 3; else ``err`` as it is."""
    from meshtrain.training.faults import CollectiveFailure, is_collective_failure

    # Those of the training loop were said there (main); one seen here came before it, or after.
    if startup_signals.phase() != "start-up" or not is_collective_failure(err):
        return err, None
    first = str(err).strip().splitlines()[0][:200]
    rank = os.environ.get("RANK", "0")
    return CollectiveFailure(f"rank {rank}: a collective failed during start-up: another rank died or was "
                             f"stopped before training began; nothing was saved, rerun the same command "
                             f"({first})"), 3


def exit_code(err: Exception) -> int | None:
    if isinstance(err, ConfigError):  # decided before anything imported torch
        return 2
    from meshtrain.parallel import LayoutError
    from meshtrain.training.checkpoint import CheckpointError
    from meshtrain.training.faults import CollectiveFailure, NonFiniteError

    if isinstance(err, (LayoutError, CheckpointError)):
        return 2
    return 3 if isinstance(err, (CollectiveFailure, NonFiniteError)) else None


if __name__ == "__main__":
    sys.exit(run())
