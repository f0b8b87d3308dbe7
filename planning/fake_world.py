"""A fake process group to trace a rank's step on, and torch's memory tracker made to
count what that rank's GPU would hold. The dry run (planning/dry_run.py), the activation
probe (planning/activations.py) and the collective check all trace on these.
"""

from __future__ import annotations

import contextlib
import threading

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


def init_fake_world(rank: int, world_size: int) -> None:
    """This process becomes rank ``rank`` of a fake process group of ``world_size``."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # DTensor caches sharding decisions by mesh, and meshes of different ranks compare
    # equal: another rank's dry run in this process must not answer for this one.
    _clear_sharding_prop_cache()


# ---------------------------------------------------------------- memory

_in_sharding_propagation = threading.local()


@contextlib.contextmanager
def sharding_propagation_untracked():
    """DTensor works out an op's output shape by running the op on fake tensors of the
    *global* shape (`ShardingPropagator._propagate_tensor_meta_non_cached`): no memory on
    a GPU. torch's trackers skip them by checking that they run under a fake mode of their
    own, which is not so when the whole step is fake: the propagation reuses our mode, and
    the tracker counted a 128K-vocabulary fp32 logit tensor per loss-parallel op (17.5
    GiB of a 70B tp 8 step that needs 4). This marks the propagation so the tracker skips it."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self, op_schema):
        _in_sharding_propagation.on = True
        try:
            return original(self, op_schema)
        finally:
            _in_sharding_propagation.on = False

    ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def peak_only(tracker_cls):
    """The tracker keeps a snapshot per module at every op (hundreds of modules x every op
    of a 70B step); only the rank's overall peak is reported here, so skip the rest. And
    tensors of DTensor's sharding propagation are not memory (see above)."""
    class PeakOnly(tracker_cls):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def _track(self, reftype, t) -> None:
            if not getattr(_in_sharding_propagation, "on", False):
                super()._track(reftype, t)
    return PeakOnly


def memory_tracker(parts, optimizers):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if len(parts) == 1 and isinstance(parts[0], FSDPModule):
        class EveryOptimizer(peak_only(FSDPMemTracker)):
            """FSDPMemTracker follows one optimizer (its state, and what its step allocates);
            [optimizer] name = "Muon" gives a part two, Muon's first. The others' state is
            optimizer state too (their steps are fused AdamW's, not traced)."""
            def _instrument_optimizer(self) -> None:
                super()._instrument_optimizer()
                for opt in optimizers.optimizers[1:]:
                    self._track_optimizer_states(_FSDPRefType.OPT, opt)

        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
        return EveryOptimizer(parts[0], optimizers.optimizers[0])
    tracker = peak_only(MemTracker)()
    tracker.track_external(*parts, *optimizers.optimizers)
    return tracker


def breakdown(snapshot: dict) -> dict[str, int]:
    """The tracker's categories, grouped as people ask about them."""
    get = lambda *keys: sum(v for k, v in snapshot.items() if k in keys)
    return {
        "parameters": get("Sharded Param", "Unsharded Param", "Parameter"),
        "buffers": get("Buffer"),
        "gradients": get("Sharded Grad", "Unsharded Grad", "Gradient"),
        "optimizer state": get("OptState", "Optstate"),
        "activations": get("Activation"),
        "temporaries": get("Temp", "Inputs", "Input"),
        "collective buffers": get("All Gather", "Reduce Scatter"),
        "total": snapshot["Total"],
    }
