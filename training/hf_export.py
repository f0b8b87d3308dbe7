"""Hugging Face folders written during training: `[checkpoint] export_hf_interval = N`
writes, every N steps and at the last step, a folder that transformers'
`AutoModelForCausalLM.from_pretrained` loads as it is:

    {run}/hf/step-00000600/   config.json + model.safetensors (or shards and their index)

No conversion step after training, and no DCP checkpoint needed for it.

Gathering is collective: every rank takes part in torch's full state dict
(`get_model_state_dict(full_state_dict=True, cpu_offload=True)`), which all-gathers each
FSDP/TP-sharded tensor and keeps the whole model, on CPU, on rank 0 only. Writing is
rank 0's: the family's `save_hf` (models/registry.py) into a temporary folder beside the
target, renamed into place once complete (training/export_target.py, as `meshtrain
export` does), so a step's folder is complete or absent whatever happens mid-write.
With `[checkpoint] async_save` the files are written on a background thread while
training goes on, as checkpoints are; the next export (or the end of the run) waits for it.
Either way every rank learns whether the write succeeded, so a full disk stops all ranks
together with one message, not rank 0 alone while the others wait on a collective.

A pipeline spreads the model over stages whose full tensors rank 0 does not receive, so
export during training is for pp = 1 (training/config_checks.py refuses pp > 1); export a pipelined
run's checkpoints afterwards with `meshtrain export STEP_DIR OUT --format hf`.
"""

from __future__ import annotations

import shutil
import time
from datetime import timedelta
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from meshtrain.parallel.init import canonical_name
from meshtrain.training.checkpoint import CheckpointError, step_dir
from meshtrain.training.export_target import ExportTargetError, staged

_FULL_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


class HFExport:
    """``due(step, last)``, then ``export(step)`` on every rank; ``close()`` at the end."""

    def __init__(self, folder: Path, *, module: nn.Module, family, model_config, interval: int,
                 background: bool):
        self.folder, self.module, self.family, self.model_config = Path(folder), module, family, model_config
        self.interval, self.background, self.rank = interval, background, dist.get_rank()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hf-export") if background and self.rank == 0 else None
        self._pending: Future | None = None
        # Rank 0's word on its write travels on a group of its own with a long timeout: the
        # other ranks wait there while rank 0 writes the whole model (minutes for a large one),
        # longer than the training collectives' timeout allows. A rank 0 that dies meanwhile
        # ends the job through torchrun, not through this timeout.
        self._pg = dist.new_group(backend="gloo", timeout=timedelta(hours=24)) if dist.get_world_size() > 1 else None
        if self.rank == 0:  # an export a killed run left half-written is no step's folder: remove it
            for partial in self.folder.glob(".step-*.partial-*"):
                shutil.rmtree(partial, ignore_errors=True)

    def due(self, step: int, last: bool) -> bool:
        return step % self.interval == 0 or last

    def export(self, step: int) -> None:
        """Gather the full model (every rank), then rank 0 writes it, now or in the background."""
        self.finish_pending()
        started = time.perf_counter()
        state = get_model_state_dict(self.module, options=_FULL_ON_RANK_0)  # {} on ranks other than 0
        gathered = time.perf_counter() - started
        out = step_dir(self.folder, step)
        tensors = [(canonical_name(name), t) for name, t in state.items()]
        if not self.background:
            self._agree(self._write(tensors, out, started, gathered) if self.rank == 0 else None)
        elif self.rank == 0:
            # Where a gathered tensor is the live parameter itself (nothing to gather: one
            # shard), the optimizer would change it under the writer: copy those.
            live = {_storage(t) for t in [*self.module.parameters(), *self.module.buffers()]}
            tensors = [(name, t.clone() if _storage(t) in live else t) for name, t in tensors]
            self._pending = self._writer.submit(self._write, tensors, out, started, gathered)

    def finish_pending(self) -> None:
        """Background: wait for the write in flight (rank 0) and tell every rank how it went."""
        if not self.background:
            return
        failure, self._pending = (self._pending.result() if self._pending is not None else None), None
        self._agree(failure)

    def close(self) -> None:
        self.finish_pending()
        if self._writer is not None:
            self._writer.shutdown()

    def _write(self, tensors: list[tuple[str, torch.Tensor]], out: Path, started: float,
               gathered: float) -> str | None:
        """Rank 0: the folder at ``out`` complete, or nothing there; returns None, or why not."""
        try:
            with staged(out, "hf") as tmp:
                self.family.hf_module().save_hf(iter(tensors), self.model_config, tmp)
        except ExportTargetError as err:  # the disk's fault (full, read-only); anything else is ours: a traceback
            return str(err)
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        print(f"meshtrain: exported step {int(out.name[5:])} to {out} (Hugging Face, {size / 2**20:,.1f} MiB) "
              f"in {time.perf_counter() - started:.2f} s: gathered in {gathered:.2f} s, written "
              + ("in the background" if self.background else "on the step's path"), flush=True)
        return None

    def _agree(self, failure: str | None) -> None:
        """Rank 0's ``failure`` on every rank: all stop together, with its words."""
        said = [failure]
        if self._pg is not None:
            dist.broadcast_object_list(said, src=0, group=self._pg)
        if said[0] is not None:
            raise CheckpointError(f"[checkpoint] export_hf_interval: {said[0]}")


def _storage(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.untyped_storage().data_ptr()
