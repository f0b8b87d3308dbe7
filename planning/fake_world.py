"""A fake process group to trace a rank's step on, and torch's memory tracker made to
count what that rank's GPU would hold. The dry run (planning/dry_run.py), the activation
probe (planning/activations.py) and the collective check all trace on these.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.fsdp import FSDPModule

# Process-group name -> every group of the mesh dimension it was made for, one row each
# ([groups, group size], torch's own enumeration): the collective check derives the
# untraced ranks' groups from it. Filled while a fake world builds its meshes.
partitions: dict[str, torch.Tensor] = {}


def init_fake_world(rank: int, world_size: int) -> None:
    """This process becomes rank ``rank`` of a fake process group of ``world_size``."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    _own_groups_only()
    _fsdp_params_built_once()
    partitions.clear()
    _concatenated.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # DTensor caches sharding decisions by mesh, and meshes of different ranks compare
    # equal: another rank's dry run in this process must not answer for this one.
    _clear_sharding_prop_cache()


@contextlib.contextmanager
def one_thread():
    """A fake step computes nothing; what torch does compute are rank maps of the whole
    world (131,072 ranks: searched, compared), small ops that a second intra-op thread
    slows down on a busy 2-core machine (the collective check at 131,072 ranks: 40 s with
    two threads, 14 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def few_collections():
    """A fake step makes millions of short-lived Python objects (fake tensors, autograd
    nodes, DTensor specs). At Python's default threshold (a young collection every 700
    more allocations than frees) every tenth of every tenth is a full collection, which
    walks the whole heap: torch's modules, the fake world, the model. 405B's dry run at 512
    ranks ran 8 of them, 2.0 s of its 14 s; with young collections every 10,000 it runs
    one (0.8 s), and ends 2 s sooner. Cyclic garbage waits longer to be freed; the memory
    the tracker counts does not depend on it (the same reports of 20 configs and ranks,
    byte for byte), but for the gradients torch's module hooks keep in cycles under
    frozen weights (LoRA), which docs/dry_run.md describes."""
    before = gc.get_threshold()
    gc.set_threshold(10_000, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


# ---------------------------------------------------------------- a mesh of 100,000 ranks

def _on_fake_group() -> bool:
    """Whether this process is a rank of a fake world: the shortcuts below apply only there."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def _own_groups_only() -> None:
    """Make a DeviceMesh on the fake group cost what this rank's own groups cost.

    Outside a fake group torch's DeviceMesh calls `new_group` for every group of every
    dimension, on every rank (it is a collective over the world), and works out its mesh
    tensor by searching the whole rank map at each `.mesh`: 1.7 and 2.5 s per mesh at
    131,072 ranks, for groups and searches a fake rank never uses -- most of a traced
    rank's time there. On the fake group, a dimension makes only the group that holds this
    rank (whose members and order are the same) and keeps every group's row in
    `partitions`; a mesh's tensor is worked out once. Other backends take torch's path."""
    if getattr(DeviceMesh, "_meshtrain_own_groups", False):
        return
    from torch.distributed.device_mesh import _MeshLayout

    make_groups, mesh_of = DeviceMesh._init_one_process_group, DeviceMesh.mesh.fget

    def init_one_process_group(sub_layout, rank_map, dim_name, backend_override):
        if not _on_fake_group() or backend_override != (None, None):
            return make_groups(sub_layout, rank_map, dim_name, backend_override)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # groups may be made inside a traced step: rows are real
            groups = _MeshLayout([sub_layout]).remap_to_tensor(rank_map)  # every group, a row each
            row = (groups == dist.get_rank()).any(dim=1).nonzero()
            mine = groups[row[0, 0]].tolist() if row.numel() else None
        if mine is None:
            return None
        if len(mine) == dist.get_world_size():
            name = dist.distributed_c10d._get_default_group().group_name  # as torch: the world's
        else:
            name = dist.new_group(ranks=mine, group_desc=f"mesh_{dim_name}").group_name
        partitions[name] = groups
        return name

    def mesh(self):
        if _on_fake_group():
            if "_meshtrain_mesh" not in self.__dict__:
                self.__dict__["_meshtrain_mesh"] = mesh_of(self)
            return self.__dict__["_meshtrain_mesh"]
        return mesh_of(self)

    equal = DeviceMesh.__eq__

    def same_mesh(self, other) -> bool:
        # torch compares the rank maps as tuples of Python ints, element by element (131,072
        # of them at every sharding lookup: 2 s a rank); one vectorized comparison says the same.
        if isinstance(other, DeviceMesh) and self is not other and _on_fake_group():
            return (self._layout == other._layout and self._device_type == other._device_type
                    and self._mesh_dim_names == other._mesh_dim_names and self._thread_id == other._thread_id
                    and (self._flatten_rank_map is other._flatten_rank_map  # a deepcopy keeps the tuple
                         or _equal(self._rank_map, other._rank_map)))
        return equal(self, other)

    def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the rank maps are real tensors, also inside a traced step
            return torch.equal(a, b)

    DeviceMesh._init_one_process_group = staticmethod(init_one_process_group)
    DeviceMesh.mesh = property(mesh)
    DeviceMesh.__eq__ = same_mesh
    DeviceMesh._meshtrain_own_groups = True


# DeviceMesh._concatenate's results on the fake group, by the meshes concatenated (kept
# alive with them, so their ids stay theirs); emptied with each new fake world.
_concatenated: dict[tuple[int, ...], tuple[list, DeviceMesh]] = {}


def _fsdp_params_built_once() -> None:
    """Make fully_shard of a TP model cost what its parameters' shards cost.

    For each parameter (1,240 on a 405B rank's two stages) FSDP2 concatenates its data-parallel and
    TP meshes into a new DeviceMesh, which copies the world's rank map into a tuple of
    Python ints (131,072 of them) and works out its mesh tensor: 1.2 s a rank; and it
    cuts the parameter into one chunk per data-parallel rank (2,048 of them) to keep one:
    1 s a rank on fake tensors. On the fake group the same meshes give the same
    concatenation once, and only the chunks FSDP reads are cut, each as torch.chunk cuts
    it (a narrow of chunk size ceil(n / chunks), empty past the last). Other backends take
    torch's path."""
    if getattr(DeviceMesh, "_meshtrain_built_once", False):
        return
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    concatenate, chunk_with_empty = DeviceMesh._concatenate, fsdp_param._chunk_with_empty

    def concatenate_once(meshes: list) -> DeviceMesh:
        if not _on_fake_group():
            return concatenate(meshes)
        key = tuple(id(m) for m in meshes)
        if key not in _concatenated:
            _concatenated[key] = (list(meshes), concatenate(meshes))
        return _concatenated[key][1]

    def chunks_read(tensor: torch.Tensor, num_chunks: int, dim: int):
        if not _on_fake_group():
            return chunk_with_empty(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)

    concatenate_once.torchs, chunks_read.torchs = concatenate, chunk_with_empty  # for the tests' comparison
    DeviceMesh._concatenate = staticmethod(concatenate_once)
    fsdp_param._chunk_with_empty = chunks_read
    DeviceMesh._meshtrain_built_once = True


class _Chunks:
    """torch.chunk(tensor, n, dim) padded with empty tensors to n (FSDP2's
    `_chunk_with_empty`), each chunk cut when it is read."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.size(dim) // n)  # torch.chunk's chunk size: ceil
        self.count = -(-tensor.size(dim) // self.size) if self.size else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        if i >= self.count:  # none at all (a dimension of 0): torch.chunk gives n empty views
            return self[0].new_empty(0) if self.count else self.tensor.narrow(self.dim, 0, 0)
        start = i * self.size
        return self.tensor.narrow(self.dim, start, min(self.size, self.tensor.size(self.dim) - start))


# ---------------------------------------------------------------- memory

_in_sharding_propagation = threading.local()

# The dispatcher asks for a fake tensor's device (a "cuda" tensor whose storage is on
# meta) about once for every op a step runs: half of what reached the tracker. It
# allocates nothing, so the fake tensor answers it at once (`peak_only`).
_DEVICE = torch.ops.prim.device.default


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
        timeline = None  # set: every update is recorded (planning/alike_memory.py)
        recording = None  # a list: every update's categories, per device (planning/alike_microbatches.py)
        collectives = None  # a CountCollectives (planning/collectives.py): shown every op here

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # A fake tensor's device: its own answer, none of the tracker's bookkeeping
            # (a 405B rank's dry run: 85,000 of its 178,000 ops, 2-4 of its 22 s).
            if func is _DEVICE and isinstance(args[0], FakeTensor):
                return FakeTensor.__torch_dispatch__(func, types, args)
            # Counting collectives here, not in a dispatch mode of their own, spares every
            # op one more trip from the dispatcher into Python and back.
            if self.collectives is not None:
                self.collectives.see(func, args)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            self.note(self._curr_mem_snap)

        def note(self, current: dict, tag=None) -> None:
            """After an update to ``current`` (categories per device): the peak, the
            timeline (under ``tag`` if given, else the timeline's own) and the recording.
            A repeated micro-batch's updates come here too (planning/alike_microbatches.py)."""
            for dev, snap in current.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
            if self.timeline is not None:
                self.timeline.record(current, tag)
            if self.recording is not None:
                self.recording.append({dev: dict(snap) for dev, snap in current.items()})

        def _track(self, reftype, t) -> None:
            if not getattr(_in_sharding_propagation, "on", False):
                super()._track(reftype, t)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # torch's MemTracker (the one for a rank without FSDP, or with several
            # pipeline stages) hooks every parameter's gradient as a module first runs,
            # and a frozen one (LoRA's base) refuses a hook: RuntimeError. Frozen
            # parameters get no gradient to track; they are marked hooked already.
            for q in module.parameters():
                if not q.requires_grad and self._param_to_grad_hook_handles.get(q) is None:
                    self._param_to_grad_hook_handles[q] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
    return PeakOnly


class _NO_HOOK:
    """What the tracker removes at its exit in place of a frozen parameter's hook."""

    @staticmethod
    def remove() -> None:
        pass


def grouped_units(tracker_cls):
    """FSDPMemTracker (torch 2.13) swaps each FSDP module's forward hooks for its own, one
    pair per module. A unit of several modules (`fully_shard([norm, output])`) runs
    torch's group hooks instead: the unit's pre-forward is one-shot and its post-forward
    runs when its last module is done. Per-module hooks end the unit after its first
    module, so its post-backward fires after the output layer's backward alone and the
    unit is gathered again for the norm's: an all-gather, a reduce-scatter and a gathered
    head (1 GiB in bf16 for Llama 3 8B) that a real step does not have. These hooks gate
    the tracker's as torch's group hooks gate FSDP's own."""
    class GroupedUnits(tracker_cls):
        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner, state = super()._fsdp_state_pre_forward(fsdp_mod, orig), fsdp_mod._get_fsdp_state()
            if len(state._modules) == 1:
                return inner

            def group_pre(*args, **kwargs):
                if not state._modules_to_run_forward:
                    state._modules_to_run_forward.update(state._modules)
                return inner(*args, **kwargs)
            return group_pre

        def _fsdp_state_post_forward(self, fsdp_mod, orig):
            inner, state = super()._fsdp_state_post_forward(fsdp_mod, orig), fsdp_mod._get_fsdp_state()
            if len(state._modules) == 1:
                return inner

            def group_post(module, inputs, output):
                if module in state._modules_to_run_forward:
                    state._modules_to_run_forward.remove(module)
                    if not state._modules_to_run_forward:
                        return inner(module, inputs, output)
                return state._cast_output_dtype(output)
            return group_post
    return GroupedUnits


def memory_tracker(parts, optimizers):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if len(parts) == 1 and isinstance(parts[0], FSDPModule):
        class EveryOptimizer(grouped_units(peak_only(FSDPMemTracker))):
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
