"""Throughput, MFU and memory numbers, and a rank-0 logger (console + the trackers)."""

from __future__ import annotations

import gc
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from meshtrain.physics.flops import flops_per_token
from meshtrain.physics.gpus import GIB, gpu_of_device
from meshtrain.training.trackers import open_tracker, resolve_trackers


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """`flops_per_token` of a whole model (on meta is fine): its embedding tables are
    lookups, except one tied to the output layer, which is also that matmul. A model whose
    tokens each use only some of its weights (a mixture of experts) says how many through
    its optional ``active_parameters()``: MFU counts those."""
    n = sum(p.numel() for p in model.parameters())  # a tied weight once
    if callable(getattr(model, "active_parameters", None)):
        n = model.active_parameters()
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    tied = sum(model.get_parameter(names[0]).numel() for names in model.tied_weights())
    return flops_per_token(params=n, embedding=tables, tied_output=tied, n_layers=model.cfg.n_layers,
                           dim=model.cfg.dim, seq_len=seq_len)


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one ``device`` (physics/gpus.py's table, matched by
    name); None on CPU or an unknown GPU (no MFU then, rather than a guess)."""
    if device.type != "cuda":
        return None
    gpu = gpu_of_device(torch.cuda.get_device_name(device))
    return gpu.peak_bf16_flops if gpu else None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB; call once at the end of each logged step.

    CUDA: ``peak_gib`` (most allocated since the previous call -- the peak counter is reset
    here), ``reserved_gib`` (held by the caching allocator), ``valley_gib`` (allocated now,
    i.e. what survives between steps: params, grads, optimizer state).
    CPU: ``rss_gib`` (resident set now) and ``peak_rss_gib`` (high-water mark of the process).
    """
    if device.type == "cuda":
        stats = {
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "valley_gib": torch.cuda.memory_allocated(device) / GIB,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    status = _proc_status_kib()
    if "VmRSS" in status:
        return {"rss_gib": status["VmRSS"] * 1024 / GIB,
                "peak_rss_gib": status.get("VmHWM", status["VmRSS"]) * 1024 / GIB}
    # No /proc (macOS): only the high-water mark is available; ru_maxrss is KiB on Linux
    # but bytes on macOS.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = maxrss / GIB if sys.platform == "darwin" else maxrss * 1024 / GIB
    return {"rss_gib": peak, "peak_rss_gib": peak}


def reset_peak_rss() -> bool:
    """Restart the process's RSS high-water mark (``peak_rss_gib``) from the current RSS, so
    two runs in one process each get their own peak. Linux only; False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class TrackedActivations(TorchDispatchMode):
    """Bytes of the tensors created inside this context that are still alive: after a
    forward pass, what autograd and activation checkpointing keep for backward.

    A CPU stand-in for the CUDA allocator's counters, so checkpointing policies can be
    compared anywhere. It sees eager ops only: kernels compiled by inductor allocate
    their buffers without going through the dispatcher, so a compiled region counts
    only its outputs. Views and in-place results share an input's storage and are not
    new memory, so parameters (and views of them, like ``w.t()``) are never counted.

        with TrackedActivations() as kept:
            loss = model(x).sum()
        print(kept.bytes())   # before loss.backward() frees them
    """

    def __init__(self):
        super().__init__()
        self._sizes = WeakIdKeyDictionary()  # storage -> bytes; an entry dies with its storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if _plain(t)}
        for t in tree_leaves(out):
            if _plain(t) and id(t.untyped_storage()) not in inputs:
                storage = t.untyped_storage()
                self._sizes[storage] = storage.nbytes()
        return out

    def bytes(self) -> int:
        gc.collect()  # a reference cycle may still hold a freed activation
        return sum(self._sizes.values())


def _plain(t) -> bool:
    # Tensor subclasses (DTensor, FSDP's wrappers) have no storage of their own here.
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta"


def _proc_status_kib() -> dict[str, int]:
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0])
    return out


# Console label and format for the keys the trainer logs; other keys get a generic format.
# The keys themselves (not the labels) are the TensorBoard tags. ``mfu`` is in percent.
_CONSOLE = {
    "loss": ("loss", "{:.4f}"),
    "lr": ("lr", "{:.2e}"),
    "grad_norm": ("grad_norm", "{:.3f}"),
    "tokens_per_second": ("tokens/s", "{:,.0f}"),
    "mfu": ("mfu", "{:.1f}%"),
    "peak_gib": ("mem", "{:.2f} GiB"),
    "peak_rss_gib": ("mem", "{:.2f} GiB"),
    "val/loss": ("val/loss", "{:.4f}"),            # training/evaluate.py, on held-out data
    "val/perplexity": ("val/perplexity", "{:.2f}"),
}
# One memory figure on the console (the peak, what decides an OOM); the rest go to
# TensorBoard only.
_TENSORBOARD_ONLY = {"rss_gib", "reserved_gib", "valley_gib"}


def _per_layer(key: str) -> bool:
    """A tag in a folder of its own, one per layer (moe/load_max_over_mean/layer3): too many
    for the console line, TensorBoard only."""
    return key.count("/") >= 2


def _format(key: str, value: float) -> str:
    if key in _CONSOLE:
        label, fmt = _CONSOLE[key]
        return f"{label} {fmt.format(value)}"
    if key.endswith("_gib"):
        return f"{key} {value:.2f} GiB"
    if isinstance(value, int):
        return f"{key} {value:,}"
    return f"{key} {value:.4g}"


def set_aside_earlier_run(log_dir: str | Path) -> Path | None:
    """A new run (not a resume) in a folder whose TensorBoard events belong to an earlier
    one: move those into ``earlier-<time they were last written>/`` beside, so TensorBoard
    shows both curves as two runs instead of one drawn over the other. Returns the folder
    they went to, or None when there were none."""
    log_dir = Path(log_dir)
    events = sorted(log_dir.glob("events.out.tfevents.*")) if log_dir.is_dir() else []
    if not events:
        return None
    written = max(e.stat().st_mtime for e in events)
    aside = log_dir / time.strftime("earlier-%Y%m%d-%H%M%S", time.localtime(written))
    while aside.exists():  # two earlier runs in one second
        aside = aside.with_name(aside.name + "-")
    aside.mkdir()
    for e in events:
        e.rename(aside / e.name)
    print(f"meshtrain: this is a new run; the earlier run's TensorBoard events are now in {aside}", flush=True)
    return aside


class MetricsLogger:
    """Console line + the trackers' scalars (training/trackers.py), written by rank 0 only.

    Every rank builds one and calls it the same way; on other ranks it holds no files and
    ``log`` does nothing. ``should_log`` is the same on every rank, so ranks can agree on
    when to run any collective that computes a logged value. ``log`` is the one place the
    scalars fan out: each tracker gets the same dict.
    """

    def __init__(self, log_dir: str | Path, *, rank: int, log_freq: int, enable_tensorboard: bool = True,
                 trackers: list[str] = ("tensorboard",), config: dict | None = None,
                 config_text: str | None = None, purge_step: int | None = None, run_name: str = "meshtrain"):
        """``log_dir``: TensorBoard's folder; the other trackers write beside it (its parent
        is the run folder). ``purge_step``: a resumed run's first step; TensorBoard drops
        what an earlier, interrupted run logged from there on, so the curve shows each step
        once. ``config``: the run's config as {section: {key: value}}, the hyperparameters."""
        if log_freq < 1:
            raise ValueError(f"log_freq must be >= 1, got {log_freq}")
        self.log_dir = Path(log_dir)
        self.rank = rank
        self.log_freq = log_freq
        self.trackers = resolve_trackers(list(trackers), enable_tensorboard) if rank == 0 else []
        self.config, self.config_text = config or {}, config_text
        self.purge_step, self.run_name = purge_step, run_name
        self._open = None  # opened on the first write: no empty files, no imports on other ranks

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.rank != 0:
            return
        scalars = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
        shown = [_format(k, v) for k, v in scalars.items() if k not in _TENSORBOARD_ONLY and not _per_layer(k)]
        print(" | ".join([f"step {step:>4d}", *shown]), flush=True)
        for tracker in self._trackers():
            tracker.log(step, scalars)

    def close(self) -> None:
        for tracker in self._open or ():
            tracker.close()
        self._open = None

    def _trackers(self) -> list:
        if self._open is None:
            self._open = [open_tracker(name, self.log_dir.parent, tb_dir=self.log_dir, run_name=self.run_name,
                                       config=self.config, config_text=self.config_text,
                                       purge_step=self.purge_step)
                          for name in self.trackers]
        return self._open
