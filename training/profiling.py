"""[profiling]: a torch.profiler trace and a memory record of a window of steps, per rank.

    [profiling]
    enable = true
    start_step = 5    # the first profiled step
    steps = 2         # steps 5 and 6

train.py wraps each step of the loop in ``profiler.step(n)``; the profiler starts when the
window's first step begins and stops when its last one ends, so the trace holds exactly
those steps, each inside a "meshtrain step N" range (and each step phase of
training/faults.py inside one of its own). Written under the run folder's profile/, by
every rank:

- rank{R}_steps{A}-{B}.pt.trace.json: the trace (Chrome JSON: Perfetto, chrome://tracing,
  or TensorBoard's profiler plugin, which reads *.pt.trace.json)
- CUDA: rank{R}_steps{A}-{B}_memory.pickle, the caching allocator's history over the
  window (every allocation with its stack), for https://pytorch.org/memory_viz
- CPU: rank{R}_steps{A}-{B}_memory.txt, the peak resident memory of each step phase,
  also printed by rank 0
- CUDA, on an out-of-memory error anywhere in the loop: rank{R}_oom.pickle, the
  allocator's state at that moment (with the window's history when it happens inside it)

docs/profiling.md says how to read them. Outside the window nothing here runs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from meshtrain.physics.gpus import GIB
from meshtrain.training.faults import step_phase
from meshtrain.training.metrics import _proc_status_kib, reset_peak_rss


class Profiler:
    def __init__(self, cfg, run_dir: Path, rank: int, device: torch.device):
        """``cfg``: the [profiling] section."""
        self.window = range(cfg.start_step, cfg.start_step + cfg.steps) if cfg.enable else range(0)
        self.folder, self.rank, self.device = Path(run_dir) / "profile", rank, device
        self._torch_profiler, self._first = None, None

    @contextlib.contextmanager
    def step(self, n: int):
        """Around one whole step of the loop; a no-op outside the window."""
        if n not in self.window:
            yield
            return
        if self._torch_profiler is None:  # the window's first step (or a resume's first inside it)
            self._start(n)
        with torch.profiler.record_function(f"meshtrain step {n}"):
            yield
        if n == self.window[-1]:
            self._stop(n)

    def close(self, last_step: int) -> None:
        """The loop ended (a stop, an error) inside the window: write what was recorded."""
        if self._torch_profiler is not None:
            self._stop(last_step)

    def _start(self, n: int) -> None:
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self._torch_profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._torch_profiler.start()
        self._first = n
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        else:
            step_phase.watcher = PhasePeaks()

    def _stop(self, last: int) -> None:
        self._torch_profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self._first}-{last}"
        self._torch_profiler.export_chrome_trace(str(self.folder / f"{name}.pt.trace.json"))
        self._torch_profiler = None
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"{name}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            memory = f"{name}_memory.pickle (https://pytorch.org/memory_viz)"
        else:
            table = step_phase.watcher.table(f"peak resident memory (RSS) of rank {self.rank}, steps "
                                             f"{self._first}-{last}, by step phase")
            step_phase.watcher = None
            (self.folder / f"{name}_memory.txt").write_text(table + "\n")
            memory = f"{name}_memory.txt"
            if self.rank == 0:
                print(table, flush=True)
        if self.rank == 0:
            print(f"meshtrain: profiled steps {self._first}-{last}: {self.folder}/rank*_steps{self._first}-{last}"
                  f".pt.trace.json (open in https://ui.perfetto.dev) and {memory}", flush=True)

    def out_of_memory(self) -> str:
        """On CUDA, after an out-of-memory error: the allocator's snapshot, and a line saying
        where it is. Empty on CPU (the kernel's OOM killer leaves nothing to write)."""
        if self.device.type != "cuda":
            return ""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}_oom.pickle"
        torch.cuda.memory._dump_snapshot(str(path))  # without a recorded history: the blocks, no stacks
        history = ("with the allocations since the window began" if self._torch_profiler is not None else
                   "blocks only; a [profiling] window over this step also records where each was allocated")
        return (f"rank {self.rank} ran out of GPU memory during {step_phase.current}; the allocator's snapshot "
                f"({history}) is {path}: open it in https://pytorch.org/memory_viz")


class PhasePeaks:
    """step_phase's watcher on CPU: the process's peak RSS inside each phase. The kernel's
    high-water mark is reset when a phase begins and read when it ends (Linux), so each
    figure is that phase's own peak. (The logged peak_rss_gib of a profiled step is then
    the last phase's.)"""

    def __init__(self):
        self.peaks: dict[str, int] = {}  # phase -> KiB
        self._ranges: list = []

    def enter(self, what: str) -> None:
        reset_peak_rss()
        self._ranges.append(torch.profiler.record_function(what))
        self._ranges[-1].__enter__()  # the phase as a range in the trace too

    def exit(self, what: str) -> None:
        self._ranges.pop().__exit__(None, None, None)
        peak = _proc_status_kib().get("VmHWM")
        if peak is not None:
            self.peaks[what] = max(self.peaks.get(what, 0), peak)

    def table(self, title: str) -> str:
        if not self.peaks:
            return f"{title}: not available (no /proc/self/status here)"
        rows = [f"  {what:<28s} {kib * 1024 / GIB:8.3f} GiB" for what, kib in self.peaks.items()]
        return "\n".join([title, f"  {'phase':<28s} {'peak RSS':>12s}", *rows])
