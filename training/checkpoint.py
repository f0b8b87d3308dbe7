"""Sharded, resumable, atomic checkpoints with torch.distributed.checkpoint (DCP).

On disk, one folder per saved step:

    {run}/checkpoint/step-00000600/   .metadata + one __R_0.distcp per rank (DCP)
                                      meta.json          step, lr schedule, data position
                                      model_config.json  the architecture (export reads it)
                                      job_config.toml    the run's whole config, for people

What is saved: the model, the optimizer state and torch's RNG state through torch's layout-agnostic
state-dict API (keys are parameter names, values DTensors), so a checkpoint written by
dp_shard 4 loads into dp 2 x tp 2 or into pipeline stages: DCP re-slices each tensor for
the reader. Each rank writes only its own shards. Only tensors go into DCP files (read
back with weights_only); everything else is JSON. DCP's own index, `.metadata`, is a
pickle: it is read through `training.checkpoint_reader.SafeReader`, which refuses anything
but the classes such an index is made of, so a checkpoint from elsewhere cannot run code.

Atomic: a save is written to `step-N.tmp` and renamed to `step-N` by rank 0 only after
DCP's metadata, written last, exists. A crash or kill at any point of a save leaves at
most a `.tmp` folder, which resume ignores and the next save removes; every `step-N` is
complete. Resume takes the newest `step-N` that has its metadata.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from meshtrain.training.checkpoint_reader import DamagedCheckpointError, SafeReader, UnsafeCheckpointError, damage
from meshtrain.training.console import say_lr_changed
from meshtrain.training.faults import NonFiniteError
from meshtrain.training.resume_compat import config_differences, model_differences
from meshtrain.training import save_failure
from meshtrain.training.rewind import load_step_in_effect, set_aside_newer

_STEP_DIR = re.compile(r"^step-(\d+)$")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which and why."""


class _ReadFailure(Exception):
    """This checkpoint could not be read (resume then tries the one before)."""


def root_cause(err: BaseException) -> str:
    """The innermost OSError's words (a full disk, a read-only folder), else the error itself.
    DCP wraps each rank's failure in a CheckpointException that lists them all."""
    failures = getattr(err, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, (first, _) = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {root_cause(first)}"
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return f"{os.strerror(seen.errno)} ({seen.filename or 'in the checkpoint folder'})"
        seen = seen.__cause__ or seen.__context__
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""  # torch's are paragraphs: one line
    return f"{type(err).__name__}: {first}"


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    found = []
    for path in folder.glob("step-*") if folder.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            if (path / ".metadata").is_file() and (path / "meta.json").is_file():
                found.append((int(match.group(1)), path))
            else:
                warnings.warn(f"skipping damaged checkpoint {path}: its DCP metadata or meta.json "
                              "is missing", stacklevel=2)
    return sorted(found)


def model_state(parts: list[nn.Module]) -> dict:
    """Parameter name -> tensor (DTensor under FSDP/TP), over every part on this rank."""
    state = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return state


def optimizer_state(parts: list[nn.Module], optimizers) -> dict:
    """Flattened optimizer state ("state.<param name>.exp_avg", ...): tensors only. The
    hyperparameters come from the config and the LR schedule, not from the file."""
    state = {}
    for part, opt in zip(parts, optimizers.per_part):
        flat = get_optimizer_state_dict(part, opt, options=_FLAT)
        state.update({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)})
    return state


def rng_state() -> dict[str, torch.Tensor]:
    """torch's global generators (dropout and other random ops draw from them). Every rank
    seeds them alike, so one copy is kept (DCP saves a replicated tensor once)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_same_model(path: Path, model_config: dict, advice: str, *, may_differ: bool = False) -> list[str]:
    """The checkpoint holds this architecture (its model_config.json, compared by what
    defines the model: `model_differences`), or CheckpointError ending in ``advice``. With
    ``may_differ`` the differences are returned instead of refused."""
    diff = model_differences(json.loads((path / "model_config.json").read_text()), model_config)
    if diff and not may_differ:
        raise CheckpointError(f"checkpoint {path} is of another model ({', '.join(diff[:6])}"
                              f"{', ...' if len(diff) > 6 else ''}); {advice}")
    return diff


def load_model(path: Path, parts: list[nn.Module], model_config) -> int:
    """The model weights of the checkpoint at ``path`` into ``parts``, under any layout
    (DCP re-slices each tensor); returns its step. Evaluation reads nothing else: no
    optimizer state, no data position, no RNG."""
    path = Path(path)
    check_same_model(path, json.loads(json.dumps(asdict(model_config))),
                     "evaluate it with the config of the run that wrote it")
    state = {"model": model_state(parts)}
    reader = SafeReader(str(path))
    try:
        reader.read_metadata()
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} could not be read: {root_cause(err)}") from None
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    return json.loads((path / "meta.json").read_text())["step"]


class CheckpointManager:
    """Saves every ``interval`` steps (and at the last step), resumes from the newest."""

    def __init__(self, folder: Path, *, parts: list[nn.Module], optimizers, schedulers, model_config,
                 job_config_text: str, interval: int, keep_latest_k: int = 0, async_save: bool = False,
                 last_save_model_only: bool = False, export_dtype: torch.dtype = torch.float32,
                 if_config_differs: str = "refuse", tied: list[tuple[str, ...]] = ()):
        self.folder = Path(folder)
        # Tied weights (model.tied_weights()): a pipeline stage may hold a copy under the
        # second name, whose optimizer state a one-stage run never wrote; read the first's.
        self.tied_source = {copy: names[0] for names in tied for copy in names[1:]}
        self.parts, self.optimizers, self.schedulers = parts, optimizers, schedulers
        self.model_config = json.loads(json.dumps(asdict(model_config)))  # tuples -> lists, as in the file
        self.job_config_text = job_config_text
        self.interval, self.keep_latest_k = interval, keep_latest_k
        self.last_save_model_only, self.export_dtype = last_save_model_only, export_dtype
        self.if_config_differs = if_config_differs
        self.rank = dist.get_rank()
        # Async saves talk over their own gloo group, so the background thread's
        # collectives never interleave with the training step's.
        self._pg = dist.new_group(backend="gloo") if async_save else None
        self._pending: tuple[Future, Path, Path, dict, float] | None = None

    # ---------------------------------------------------------------- resume

    def resume(self, load_step: int = 0) -> tuple[int, dict]:
        """Load the newest intact checkpoint (or ``load_step``); returns (step, data state)
        -- (0, {}) when there is none. A damaged one (truncated shard, unreadable index or
        meta.json) is skipped with a warning naming what is wrong, and so is one DCP fails
        to read; with none intact left, the run stops rather than start over silently.
        Rank 0 checks them newest first and only as far as needed (a check reads the DCP
        index); every rank tries the path it chose."""
        skipped: list[str] = []   # rank 0's account of what was passed over, for the error
        failed: list[str] = []
        older_than = None         # after a failed read, look below that step
        if self.rank == 0 and load_step:  # a rewind this run already made (training/rewind.py)
            found = complete_checkpoints(self.folder)
            load_step, note = load_step_in_effect(self.folder, load_step, found[-1][0] if found else None)
            if note:
                print(f"meshtrain: {note}", flush=True)
        while True:
            choice = [None]
            if self.rank == 0:
                choice[0] = self._next_intact(load_step, older_than, skipped)
            dist.broadcast_object_list(choice, src=0)
            status, value = choice[0]
            if status == "error":
                raise CheckpointError(value)
            if status == "none":
                break
            path = Path(value)
            try:
                step, data_state = self.load(path)
            except _ReadFailure as err:  # the same on every rank: DCP gathers the ranks' errors
                failed.append(f"{path.name}: {err}")
                older_than = int(_STEP_DIR.match(path.name).group(1))
                if self.rank == 0:
                    warnings.warn(f"checkpoint {path} could not be read ({err}); trying the one before",
                                  stacklevel=2)
                continue
            if self.rank == 0 and load_step:
                newer = [p for s, p in complete_checkpoints(self.folder) if s > step]
                done = set_aside_newer(self.folder, step, newer)
                if done:
                    print(f"meshtrain: {done}", flush=True)
            return step, data_state
        if failed:
            raise CheckpointError(f"no checkpoint in {self.folder} could be read: {'; '.join(failed)}. Move "
                                  f"the damaged folders away to start from scratch")
        return 0, {}

    def _next_intact(self, load_step: int, older_than: int | None, skipped: list[str]) -> tuple[str, str | None]:
        """Rank 0: ("ok", the newest intact checkpoint below ``older_than``), ("none", None)
        when there is no checkpoint at all, or ("error", why)."""
        found = complete_checkpoints(self.folder)
        if load_step:
            if not any(s == load_step for s, _ in found):
                return "error", (f"[checkpoint] load_step = {load_step}: no complete checkpoint for that step "
                                 f"in {self.folder} (have: {[s for s, _ in found] or 'none'})")
            found = [(s, p) for s, p in found if s == load_step]
        for step, path in reversed(found):
            if older_than is not None and step >= older_than:
                continue
            try:
                problem = damage(path)
            except UnsafeCheckpointError as err:  # crafted, not damaged: refuse the run, skip nothing
                return "error", str(err)
            if problem is None:
                return "ok", str(path)
            skipped.append(f"{path.name}: {problem}")
            warnings.warn(f"skipping damaged checkpoint {path}: {problem}", stacklevel=3)
        if skipped and older_than is None:
            return "error", (f"no intact checkpoint to resume from in {self.folder}: {'; '.join(skipped)}. "
                             f"Move the damaged folders away to start from scratch")
        return "none", None

    def load(self, path: Path) -> tuple[int, dict]:
        meta = json.loads((path / "meta.json").read_text())
        model_diff = check_same_model(
            path, self.model_config, "point [job] output_dir / name elsewhere or change the model back, or set "
            "[checkpoint] if_config_differs = \"resume\" if the weights still fit (their shapes are checked as "
            "they load)", may_differ=self.if_config_differs == "resume")
        if model_diff and self.rank == 0:
            warnings.warn(f"resuming {path}, written for another model config, because [checkpoint] "
                          f"if_config_differs = \"resume\": {', '.join(model_diff)}", stacklevel=2)
        saved_job = path / "job_config.toml"
        if self.if_config_differs != "resume" and saved_job.is_file():
            diff = config_differences(saved_job.read_text(), self.job_config_text)
            if diff:
                raise CheckpointError(
                    f"{path} was written by a run with another config ({'; '.join(diff[:6])}"
                    f"{'; ...' if len(diff) > 6 else ''}). Resuming would mix two experiments: set "
                    f"[checkpoint] if_config_differs = \"resume\" to continue anyway, or point "
                    f"[job] output_dir / name at a new folder")
        if not meta.get("model_only") and saved_job.is_file():
            self._check_same_optimizer(path, saved_job.read_text())
        state = {"model": model_state(self.parts)}
        opt, copies = {}, []
        if not meta.get("model_only"):
            opt = optimizer_state(self.parts, self.optimizers)
            state["optimizer"], copies = self._read_tied_from_source(opt)
        if meta.get("rng"):
            state["rng"] = rng_state()  # filled in place, then installed
        reader = SafeReader(str(path))
        try:
            reader.read_metadata()  # before DCP: a refused index is named plainly, on every rank
        except UnsafeCheckpointError as err:
            raise CheckpointError(str(err)) from None
        except (DamagedCheckpointError, FileNotFoundError) as err:
            raise _ReadFailure(str(err)) from None
        try:
            dcp.load(state, storage_reader=reader)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            raise _ReadFailure(root_cause(err)) from err
        with torch.no_grad():
            for copy, source in copies:  # this rank holds both: the copy takes the source's values
                copy.copy_(opt[source])
        if "optimizer" in state:
            state["optimizer"] = opt  # DCP loaded in place: every key as this run names it
        for part in self.parts:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if "rng" in state:
            set_rng_state(state["rng"])
        if "optimizer" in state:
            for part, opt in zip(self.parts, self.optimizers.per_part):
                full = get_optimizer_state_dict(part, opt, options=_FLAT)  # this run's hyperparameters
                full.update({k: v for k, v in state["optimizer"].items() if k in full})
                set_optimizer_state_dict(part, opt, full, options=_FLAT)
            self.schedulers.load_state_dict(meta["lr_scheduler"])
            saved_peak = (meta["lr_scheduler"].get("base_lrs") or [None])[0]
            if saved_peak is not None and saved_peak != self.schedulers.peak_lr:
                say_lr_changed(saved_peak, self.schedulers.peak_lr, meta["step"], self.schedulers.get_last_lr()[0])
        return meta["step"], meta.get("dataloader", {})

    def _check_same_optimizer(self, path: Path, saved_toml: str) -> None:
        """AdamW's moments and Muon's momentum are different state: a checkpoint of one
        cannot resume the other, whatever if_config_differs says."""
        import tomllib

        name = lambda text: tomllib.loads(text).get("optimizer", {}).get("name", "AdamW")
        saved, now = name(saved_toml), name(self.job_config_text) if self.job_config_text else "AdamW"
        if saved != now:
            raise CheckpointError(
                f'{path} holds the state of [optimizer] name = "{saved}", and this run\'s name = "{now}" keeps '
                f'other state, so it cannot resume from it: use name = "{saved}", or point [job] output_dir / '
                f"name at a new folder")

    def _read_tied_from_source(self, opt: dict) -> tuple[dict, list]:
        """The optimizer state to request from DCP, with a tied copy's entries
        ("state.lm_head.weight.exp_avg") read under the first name's key, which holds the
        same values; and the (copy, source key) pairs for a rank that holds both."""
        request, copies = {}, []
        for key, value in opt.items():
            name = next((n for n in self.tied_source if key.startswith(f"state.{n}.")), None)
            source = key if name is None else f"state.{self.tied_source[name]}." + key[len(f"state.{name}."):]
            if source == key or source not in opt:
                request[source] = value
            else:
                copies.append((value, source))
        return request, copies

    # ---------------------------------------------------------------- save

    def should_save(self, step: int, last: bool) -> bool:
        return step % self.interval == 0 or last

    def save(self, step: int, *, data_state: dict, last: bool = False) -> None:
        """Write step ``step``; returns at once under async save (the previous async save
        is finished first)."""
        self.finish_pending()
        started = time.perf_counter()
        final = step_dir(self.folder, step)
        tmp = final.with_name(final.name + ".tmp")
        exists = [False]
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died before
            problem = damage(final) if final.exists() else None
            if problem is not None:
                # Damaged (e.g. its index is gone): set it aside, or this step would never be saved.
                aside = final.with_name(f"{final.name}.damaged-{int(time.time())}")
                warnings.warn(f"{final} is damaged ({problem}); moved to {aside.name} and saved anew",
                              stacklevel=2)
                final.rename(aside)
            exists[0] = final.exists()
        dist.broadcast_object_list(exists, src=0)
        if exists[0]:
            return  # never overwrite a complete checkpoint
        model_only = last and self.last_save_model_only
        state = {"model": model_state(self.parts)}
        if model_only:
            state["model"] = {k: v.to(self.export_dtype) for k, v in state["model"].items()}
        else:
            state["optimizer"] = optimizer_state(self.parts, self.optimizers)
            state["rng"] = rng_state()
        if not _finite_on_every_rank([*state["model"].values(), *state.get("optimizer", {}).values()]):
            # An update that overflowed (lr far too high) leaves inf/NaN weights behind a
            # finite loss. Saved, they would be the checkpoint every restart resumes from.
            raise NonFiniteError(f"step {step}: the weights or optimizer state are not finite (inf/NaN), so "
                                 f"step {step} was not saved; {self.newest()}. An update overflowed: lower "
                                 f"[optimizer] lr")
        meta = {"step": step, "model_only": model_only, "dataloader": data_state,
                "lr_scheduler": self.schedulers.state_dict(), "rng": "rng" in state}
        dist.barrier()  # the stale .tmp is gone on every rank's view before anyone writes
        need = save_failure.state_bytes(state)
        try:
            if self._pg is not None:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
                self._pending = (future, tmp, final, meta, started, need)
            else:
                dcp.save(state, checkpoint_id=str(tmp))
                self._finalize(tmp, final, meta, started)
        except (Exception, CheckpointException) as err:
            if (failure := self._save_failed(final, err, need)) is None:
                raise
            raise failure from err

    def finish_pending(self) -> None:
        if self._pending is not None:
            future, tmp, final, meta, started, need = self._pending
            self._pending = None
            try:
                future.result()  # where an async save's failure surfaces: at the next save, or close
                self._finalize(tmp, final, meta, started)
            except (Exception, CheckpointException) as err:
                if (failure := self._save_failed(final, err, need)) is None:
                    raise
                raise failure from err

    def newest(self) -> str:
        """Where a rerun resumes from, in words."""
        kept = complete_checkpoints(self.folder)
        return (f"the newest complete checkpoint is {kept[-1][1].name} in {self.folder}" if kept else
                f"there is no complete checkpoint in {self.folder}")

    def _save_failed(self, final: Path, err: BaseException, need: int) -> CheckpointError | None:
        """CheckpointError with the file system's reason (training/save_failure.py); None for
        any other failure, which keeps its traceback: not the disk's fault, maybe ours."""
        reason = save_failure.describe(err, self.folder, need)
        if reason is None:
            return None
        kept = [p.name for _, p in complete_checkpoints(self.folder)]
        return CheckpointError(f"saving {final} failed: {reason}. Nothing complete was touched: "
                               f"{', '.join(kept) or 'no earlier checkpoint'} in {self.folder} "
                               f"{'are' if len(kept) > 1 else 'is'} intact")

    def _finalize(self, tmp: Path, final: Path, meta: dict, started: float) -> None:
        """Rank 0, after DCP wrote its metadata (so every rank's shards are on disk):
        the side files, then one rename makes the checkpoint visible."""
        if self.rank != 0:
            return
        _write(tmp / "meta.json", json.dumps(meta, indent=1))
        _write(tmp / "model_config.json", json.dumps(self.model_config, indent=1))
        _write(tmp / "job_config.toml", self.job_config_text)
        tmp.rename(final)
        what = "model weights" if meta["model_only"] else "model, optimizer and data position"
        print(f"meshtrain: saved step {meta['step']} ({what}) to {final} in {time.perf_counter() - started:.1f} s"
              + (" (written in the background)" if self._pg is not None else ""), flush=True)
        if self.keep_latest_k:
            for _, old in complete_checkpoints(self.folder)[:-self.keep_latest_k]:
                # Renamed first, so a crash mid-delete cannot leave a half-deleted step-N.
                doomed = old.with_name(old.name + ".deleting")
                old.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def close(self) -> None:
        self.finish_pending()


def _finite_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor of every rank is finite: each rank checks its own shards (one
    device sync), then one all-reduce tells all of them, so all refuse the save together."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    # The flag travels on the process group's device (NCCL: the GPU), wherever a tensor
    # lives (CPU offload keeps parameters on the host).
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flags = [(~torch.isfinite(t)).any().to(device) for t in local if t.is_floating_point() and t.numel()]
    bad = (torch.stack(flags).any() if flags else torch.tensor(False, device=device)).float().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def _write(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
