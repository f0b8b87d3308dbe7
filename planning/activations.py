"""Activation memory of a layout, measured by tracing a short copy of the model, not guessed.

    profile = activation_profile(ProbeKey("llama", "70B", 128256, seq_len=8192, tp=8, ac="full"))
    profile.blocks   # bytes one block keeps for its backward, per sequence

The probe builds the model with two activation-checkpointing periods of blocks (2 blocks;
4 for selective every 2), applies the real TP plan (sequence and loss parallel), the real
AC wrapper and policy, casts to the compute dtype, and runs one sequence's forward, loss
and backward on fake tensors on a fake process group of `tp` ranks -- the machinery of the
dry run (planning/fake_world.py). Torch's memory tracker counts every tensor; module and
gradient hooks read its counters at each block's boundary:

    embed          the embedding's output (the first block's input)
    blocks[j]      what block j of an AC period keeps from its forward to its backward
    head           the final norm, output layer and loss: kept from forward to backward
    head_working   the peak of the loss and head backward, above everything kept
    block_working  the peak of one block's backward (recomputation, input gradients),
                   above what is kept by it and the blocks before it
    forward_extra  the forward's peak above what it keeps (the loss's fp32 copies)
    stage_input    a later pipeline stage's input, [s/tp, dim] in the compute dtype

Compiled blocks ([compile] enable) keep less: inductor's partitioner saves a few tensors
and recomputes the element-wise ops between them in backward (the norms' fp32 upcasts, the
SwiGLU product). What it saves is read off the partitioner itself: each block compiled with
torch's "aot_eager_decomp_partition" backend (inductor's decompositions and min-cut
partitioner, no kernels generated), on the same fake tensors, and the tensors its forward
saves for backward counted (`compiled_blocks`). Torch's memory tracker is a dispatch mode,
under which dynamo does not compile, so the rest of the profile is the eager trace's.

All of it is per sequence: activations are proportional to the micro-batch (flash
attention keeps no s x s term). Parameters and their gradients are not activations: the
probe runs without FSDP and asks autograd for the activations' gradients only; FSDP's
gathered units and gradients are counted in planning/memory.py from the parameter counts.
Profiles are cached per key, so a search over hundreds of layouts traces each (sequence,
tp, AC mode) once, in about a second; the search traces the ones it will need first, one
process per core (`trace_probes`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

ACT_KINDS = ("Activation", "Temp", "Inputs", "Input")


@dataclass(frozen=True)
class ProbeKey:
    family: str
    flavor: str
    vocab_size: int
    seq_len: int
    tp: int = 1
    ac: str = "none"
    ac_every: int = 2
    dtype: str = "bfloat16"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    lora: tuple = ()  # [lora]: (rank, alpha, target_modules); a frozen layer saves less for backward
    dims: tuple = ()  # [model]'s dimensions over the flavor's (ModelShape.dims)
    experts: bool = False  # a mixture of experts: probe its MoE blocks (else its dense ones)
    chunked_loss: bool = False  # [training] chunked_loss: the loss keeps no fp32 copy of the logits
    compiled: bool = False  # [compile] enable: each block compiled, keeping what inductor's partitioner saves


@dataclass(frozen=True)
class ActivationProfile:
    embed: float
    blocks: tuple[float, ...]
    head: float
    head_working: float
    block_working: float
    forward_extra: float
    stage_input: float

    def kept(self, n_blocks: int) -> float:
        """What a stage of ``n_blocks`` keeps from its blocks: AC wraps every
        ``period``-th block counting from each stage's first (parallel/activation_checkpoint.py)."""
        period = len(self.blocks)
        return sum(self.blocks[j % period] for j in range(n_blocks))


def probe_key(model, seq_len: int, tp: int, ac: str, lora: tuple = (), chunked_loss: bool = False,
              sequence_parallel: bool = True, loss_parallel: bool = True, compiled: bool = False) -> ProbeKey | None:
    """The probe of a planner ModelShape's block at ``seq_len`` tokens per rank, or None
    for a family that cannot build a short copy of itself from a flavor (hf)."""
    from meshtrain.models import registry

    family = registry.FAMILIES.get(model.family)
    if family is None or model.flavor not in family.flavors:
        return None
    c = dataclasses.replace(family.flavors[model.flavor], **dict(model.dims))
    if (c.dim, c.n_heads, c.ffn_hidden) != (model.dim, model.n_heads, model.ffn_hidden):
        return None  # a config that changes the flavor's shape: the probe would trace another block
    # Without TP both are moot: one key for every such probe.
    sequence_parallel, loss_parallel = (sequence_parallel, loss_parallel) if tp > 1 else (True, True)
    return ProbeKey(model.family, model.flavor, model.vocab, seq_len=seq_len, tp=tp, ac=ac, lora=lora,
                    dims=model.dims, experts=model.moe_layers > 0, chunked_loss=chunked_loss,
                    sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, compiled=compiled)


def period_of(key: ProbeKey) -> int:
    return key.ac_every if key.ac == "selective" else 1


_profiles: dict[ProbeKey, ActivationProfile] = {}  # every probe traced in this process, or sent by a child


def trace_probes(keys, jobs: int | None = None) -> None:
    """Trace the probes of ``keys`` not traced yet, one forked process per core
    (planning/forked.py): a layout search needs a dozen or more, each independent."""
    from meshtrain.planning.forked import map_forked

    todo = sorted(set(keys) - set(_profiles) - {None}, key=repr)
    for key, profile in zip(todo, map_forked(activation_profile, todo, jobs)):
        _profiles[key] = profile


def activation_profile(key: ProbeKey) -> ActivationProfile:
    """The probe for ``key`` (see the module docstring), traced once per key."""
    if key not in _profiles:
        _profiles[key] = _traced_profile(key)
    return _profiles[key]


def _traced_profile(key: ProbeKey) -> ActivationProfile:
    import torch.distributed as dist

    from meshtrain.planning.fake_world import init_fake_world, sharding_propagation_untracked

    if dist.is_initialized():  # the probe needs a fake world of its own
        raise RuntimeError("planning.activations traces on a fake process group of its own: call it "
                           "outside a run, or after destroy_process_group()")
    init_fake_world(0, key.tp)
    try:
        with sharding_propagation_untracked():
            return _trace(key)
    finally:
        dist.destroy_process_group()


def _probe_model(key: ProbeKey, backend=None):
    """The probe's short model, parallelized as a run would be; with ``backend``, each block
    also compiled with it."""
    from meshtrain.models import registry
    from meshtrain.parallel import ParallelDims, parallelize

    family = registry.get(key.family)
    overrides = {**dict(key.dims), "vocab_size": key.vocab_size, "n_layers": 2 * period_of(key)}
    if hasattr(family.flavors[key.flavor], "n_dense_layers"):
        # A mixture of experts: the probe's blocks are all MoE blocks (its few dense first
        # blocks are counted as MoE ones: DeepSeek-V3's 3 of 61), or all dense (its dense twin).
        overrides["n_dense_layers"] = 0 if key.experts else overrides["n_layers"]
    if not family.learned_positions:  # as training.recipe.build_model sizes rotary tables
        overrides["max_seq_len"] = key.seq_len
    model = family.model_class().from_flavor(key.flavor, meta=True, **overrides)
    if key.lora:  # as training.recipe.build_model adds them: the base frozen
        from meshtrain.parallel.lora import apply_lora

        rank, alpha, targets = key.lora
        apply_lora(model, rank=rank, alpha=alpha, target_modules=list(targets), exclude=family.high_precision)
    model.to(getattr(torch, key.dtype))  # FSDP's mixed precision, without FSDP (on meta: free)
    mesh = ParallelDims(tp=key.tp, dp_shard=1, world_size=key.tp).build_mesh("cpu")
    cfg = model.cfg
    model = parallelize(model, mesh, sequence_parallel=key.sequence_parallel, loss_parallel=key.loss_parallel,
                        activation_checkpoint=key.ac, ac_every=key.ac_every)
    if backend is not None:
        from meshtrain.parallel.activation_checkpoint import apply_compile

        blocks = list(model.transformer_blocks().values())
        apply_compile([b for i, b in enumerate(blocks) if not whole_block_recomputed(key, i)], root=model,
                      backend=backend)
    return model, cfg


def whole_block_recomputed(key: ProbeKey, i: int) -> bool:
    """Whether AC recomputes all of block i (parallel/activation_checkpoint.py apply_ac): it
    keeps only its input, compiled or not."""
    return key.ac == "full" or (key.ac == "selective" and i % key.ac_every == 0)


class _PartitionOnly:
    """A torch.compile backend: inductor's decompositions and partitioner, the graphs run
    eagerly; it counts the graphs it was given, so a block that did not compile is an error."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.inner, self.graphs = lookup_backend("aot_eager_decomp_partition"), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def compiled_blocks(key: ProbeKey) -> dict[int, float]:
    """What each block of the probe that AC does not recompute whole keeps from its forward
    to its backward when compiled, by the block's index: the storages its compiled forward
    saves for backward (not the parameters', not its input's, which the block before keeps)
    and its output, once each."""
    # torch warns that a checkpoint's context_fn is traced under torch.compile (AC "op"): about
    # meshtrain's own blocks, which this traces on purpose; noise in a plan's output.
    quiet = logging.getLogger("torch._higher_order_ops.wrap")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _compiled_blocks(key)
    finally:
        quiet.setLevel(level)


def _compiled_blocks(key: ProbeKey) -> dict[int, float]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from meshtrain.training.step import logits_of

    # Fresh caches: probes of other shapes in this process must not reach dynamo's recompile
    # limit, past which it would run the block eagerly.
    torch._dynamo.reset()
    backend = _PartitionOnly()
    model, cfg = _probe_model(key, backend)
    blocks = list(model.transformer_blocks().values())
    kept, current, inputs = [dict() for _ in blocks], [None], {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        # The compiled graph takes a TP-sharded parameter's local shard and may save it.
        fixed = {StorageWeakRef(getattr(t, "_local_tensor", t).untyped_storage())
                 for t in (*model.parameters(), *model.buffers())}

        def storages(x):
            return [StorageWeakRef(getattr(t, "_local_tensor", t).untyped_storage())
                    for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]

        def before(i):
            def hook(module, args):
                current[0] = i
                inputs[i] = set(storages(args))
            return hook

        def count(i, t):  # a storage once, however many views of it are saved
            local = getattr(t, "_local_tensor", t)
            kept[i][StorageWeakRef(local.untyped_storage())] = local.untyped_storage().nbytes()

        def after(i):
            def hook(module, args, out):
                current[0] = None
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        count(i, t)
            return hook

        def pack(t):
            if current[0] is not None:
                count(current[0], t)
            return t

        hooks = [b.register_forward_pre_hook(before(i)) for i, b in enumerate(blocks)]
        hooks += [b.register_forward_hook(after(i)) for i, b in enumerate(blocks)]
        tokens = torch.randint(0, cfg.vocab_size, (1, key.seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits_of(model(tokens))
        for h in hooks:
            h.remove()
    if backend.graphs == 0:
        raise RuntimeError(f"the probe's blocks did not compile ({key})")
    return {i: sum(n for ref, n in k.items() if ref not in fixed and ref not in inputs[i])
            for i, k in enumerate(kept) if not whole_block_recomputed(key, i)}


class _Levels:
    """Reads the tracker: the bytes of activations now, and their peak since `mark`."""

    def __init__(self, tracker):
        self.tracker, self.peak = tracker, 0.0
        original = tracker._update_peak_stats

        def update(state, original=original):
            self.peak = max(self.peak, self.now())
            original(state)
        tracker._update_peak_stats = update

    def now(self) -> float:
        snap = next(iter(self.tracker._curr_mem_snap.values()), {})
        return float(sum(snap.get(k, 0) for k in ACT_KINDS))

    def mark(self) -> float:
        """The peak since the last mark; the next one starts from now."""
        peak, self.peak = max(self.peak, self.now()), self.now()
        return peak


def _trace(key: ProbeKey) -> ActivationProfile:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshtrain.parallel import loss_parallel_context
    from meshtrain.planning.fake_world import peak_only
    from torch.distributed._tools.mem_tracker import MemTracker
    from meshtrain.training.step import logits_of, loss_function

    model, cfg = _probe_model(key)
    blocks = list(model.transformer_blocks().values())
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tracker = peak_only(MemTracker)()
        if key.lora:  # torch's tracker hooks every parameter's gradient, which a frozen one refuses;
            # the probe makes no parameter gradient anyway (only the activations' below)
            track = tracker._track_module_params_and_buffers
            tracker._track_module_params_and_buffers = lambda module, install_grad_hooks=True: track(module, False)
        tracker.track_external(model)
        levels = _Levels(tracker)
        pre, post, phases, outputs, inputs = [], [], [], [], []
        forward = [True]

        def before(module, args):
            if forward[0]:
                pre.append(levels.now())
                if not args[0].requires_grad:  # [lora]: the frozen embedding's output; backward starts here
                    args = (args[0] + torch.zeros((), dtype=args[0].dtype, requires_grad=True), *args[1:])
                inputs.append(args[0])
                return args

        def after(module, args, out):
            if forward[0]:
                post.append(levels.now())
                outputs.append(out)

        hooks = [b.register_forward_pre_hook(before) for b in blocks]
        hooks += [b.register_forward_hook(after) for b in blocks]
        tokens = torch.randint(0, cfg.vocab_size, (1, key.seq_len))
        parallel_loss = key.tp > 1 and key.loss_parallel
        with tracker, loss_parallel_context(parallel_loss):
            start = levels.now()
            levels.mark()
            loss = loss_function(chunked=key.chunked_loss)(logits_of(model(tokens)), tokens)
            end_of_forward = levels.now()
            forward_peak = levels.mark()
            forward[0] = False
            for out in outputs:  # fires when the gradient of a block's output is complete:
                out.register_hook(lambda grad: phases.append(levels.mark()))  # the blocks after it are done
            # Activation gradients only, down to the first block's input: the parameters'
            # gradients are FSDP's business (planning/memory.py counts them), and a
            # backward that made them would mix them into every working set.
            torch.autograd.grad(loss, inputs[0])
            phases.append(levels.mark())  # the first block
        for h in hooks:
            h.remove()
        del loss
        inputs.clear()
        outputs.clear()
    n = len(blocks)
    kept = [post[i] - pre[i] for i in range(n)]
    embed = pre[0] - start
    head = end_of_forward - post[-1]
    # phases[0]: the head and loss backward; phases[k]: block n - k's backward.
    head_working = phases[0] - end_of_forward
    stack = lambda i: embed + sum(kept[: i + 1])  # kept by the embedding and blocks 0..i
    block_working = max(phases[n - i] - start - stack(i) for i in range(n))
    period = period_of(key)
    act_seq = key.seq_len // key.tp if key.tp > 1 and key.sequence_parallel else key.seq_len
    if key.compiled and not all(whole_block_recomputed(key, i) for i in range(n)):
        # The backward working set stays the eager one's: an upper bound.
        compiled = compiled_blocks(key)
        kept = [compiled.get(i, kept[i]) for i in range(n)]
    return ActivationProfile(
        embed=embed, blocks=tuple(kept[period:2 * period]), head=head, head_working=head_working,
        block_working=block_working, forward_extra=forward_peak - end_of_forward,
        stage_input=act_seq * cfg.dim * getattr(torch, key.dtype).itemsize)
