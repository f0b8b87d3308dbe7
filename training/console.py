"""What rank 0 tells the user about a run, one line each: how it is laid out before the
first step, that a finished job has nothing left to do, that a signal stopped it, and a
summary at the end. (The per-step line is training/metrics.py's.)"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist


def announce(n_params: int, layout, grad_accum: int, mesh, start_step: int, run_dir: Path,
             trainable: int | None = None) -> None:
    """One line before the first step: the mesh, the model, how each step's batch is cut."""
    if dist.get_rank() != 0:
        return
    local = layout.local_batch * grad_accum  # sequences per data-parallel rank per step
    batch = f"{local} sequences per data-parallel rank per step"
    if grad_accum > 1:
        batch += f", as {grad_accum} accumulated forward/backward passes of {layout.local_batch}"
        if not layout.pipelined:
            batch += (", gradients reduced once, after the last" if layout.reduces_once else
                      ", gradients reduced after each")
    if layout.pipelined:
        batch += (f" | pipeline {layout.pp_schedule}: {len(layout.stage_layers)} stages of "
                  f"{'/'.join(str(len(s)) for s in layout.stage_layers)} layers, each pass cut into "
                  f"{layout.pp_microbatches} micro-batches of {layout.micro_batch}")
    resumed = f" | resumed at step {start_step}" if start_step else ""
    params = f"{n_params / 1e6:,.1f}M parameters"
    if trainable is not None and trainable < n_params:  # LoRA: the adapters alone train
        params += f" ({trainable / 1e6:,.3f}M trainable: LoRA adapters)"
    experts = (f" | experts split over ep {layout.ep} of the dp_shard ranks (FSDP over the "
               f"{layout.dp_shard // layout.ep} left)" if getattr(layout, "ep", 1) > 1 else "")
    print(f"meshtrain: {mesh}{experts} | {params} | {batch}{resumed} | logs in {run_dir}",
          flush=True)


def say_nothing_to_do(start_step: int, steps: int, checkpoint) -> None:
    if dist.get_rank() == 0:
        print(f"meshtrain: nothing to do: the newest checkpoint in {checkpoint.folder} is step {start_step} "
              f"and [training] steps = {steps}. Raise it to train on (e.g. --training.steps {2 * start_step})",
              flush=True)


def say_lr_changed(saved_peak: float, peak: float, step: int, lr: float) -> None:
    """A resumed run whose [optimizer] lr differs from the checkpoint's: the config wins
    (training/optim.py, Schedulers.load_state_dict), and the user sees which lr applies."""
    if dist.get_rank() == 0:
        print(f"meshtrain: [optimizer] lr = {peak:g} applies from step {step + 1} (lr {lr:g} there, on this run's "
              f"schedule); the checkpoint was trained at peak lr {saved_peak:g}", flush=True)


def say_stopped(signal_name: str, step: int, checkpoint) -> None:
    if dist.get_rank() == 0:
        saved = "checkpoint saved; run the same command to resume" if checkpoint else \
            "checkpointing is off, so a rerun starts over"
        print(f"meshtrain: {signal_name} received: stopped after step {step}; {saved}", flush=True)


def say_done(start_step: int, last: int, seconds: float, tokens_per_step: int, loss: float,
             checkpoint, run_dir: Path) -> None:
    if dist.get_rank() != 0:
        return
    saved = f"checkpoints in {checkpoint.folder}" if checkpoint else "no checkpoints ([checkpoint] enable = false)"
    print(f"meshtrain: done: steps {start_step + 1}-{last} in {seconds:.1f} s ({(last - start_step) * tokens_per_step:,} tokens), "
          f"final loss {loss:.4f} | {saved} | tensorboard --logdir {run_dir / 'tb'}", flush=True)
