"""Activation checkpointing and torch.compile, per transformer block.

Both wrap blocks *after* TP (so they see the sharded modules) and *before* FSDP (so FSDP's
all-gather hooks sit outside the recomputed region and run once, not twice).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshtrain.parallel.vocabulary import AC_MODES


def _ops(*names: str) -> frozenset:
    """The default overloads of the named ops that this build of torch has: the
    attention kernels differ by backend (flash / efficient / cuDNN on GPU, one for CPU)."""
    found = set()
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, "default"):
            found.add(packet.default)
    return frozenset(found)


# Op-level selective checkpointing keeps the outputs of the ops that are expensive to
# redo -- matmuls (most of the FLOPs), attention (O(s^2) work), and collectives (a
# recomputed all-gather would cross the network again) -- and recomputes everything
# cheap and element-wise in between: norms, rotary embedding, SiLU, residual adds.
SAVED_OPS = _ops(
    "aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_mm",  # _scaled_mm: float8 matmuls
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_reduce",
)


def save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The policy of mode "op". MUST_SAVE, not PREFER_SAVE: under torch.compile the
    partitioner may otherwise choose to recompute a matmul to save memory."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(blocks, mode: str, every: int = 2, *, root: nn.Module | None = None) -> list[nn.Module]:
    """``full``: recompute every block's activations in backward (keeps only block inputs:
    about 2·s·b·h bytes per layer instead of tens of times that). ``selective``: only every
    ``every``-th block, trading part of the memory saving for less recomputation. ``op``:
    every block, but only its cheap ops are recomputed (see SAVED_OPS): the element-wise
    activations are dropped, the matmul and attention outputs kept, so backward redoes
    little compute.

    ``blocks``: a ModuleList / ModuleDict of blocks, or a list of block modules found
    anywhere in ``root``. Each wrapper replaces its block in the block's parent, so the
    model calls it and FSDP, applied next, shards the wrapper. Returns the blocks as they
    now are (wrapped or not), in order."""
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpoint mode {mode!r}; accepted: {', '.join(AC_MODES)}")
    slots = block_slots(blocks, root)
    if mode == "none":
        return [block for _, _, block in slots]
    out = []
    for i, (parent, name, block) in enumerate(slots):
        if mode == "op":
            block = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, save_expensive_ops))
        elif mode == "full" or i % every == 0:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        setattr(parent, name, block)
        out.append(block)
    return out


def apply_compile(blocks, *, root: nn.Module | None = None, backend="inductor") -> list[nn.Module]:
    """Compile each block separately: blocks are identical, so one graph is reused for all
    of them, and FSDP's per-block hooks stay outside the compiled regions. ``blocks`` and
    ``root`` as for `apply_ac`; ``backend`` as torch.compile's; returns the compiled blocks."""
    # A block that keeps statistics of its forward (a mixture of experts counting its
    # experts' loads) updates them once per forward; eager checkpointing's recomputation
    # leaves them alone too (the block asks whether autograd's engine is running). Under
    # compile, dynamo refuses such updates inside a checkpointed region unless told that
    # the recomputation need not replay them.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    out = []
    for parent, name, block in block_slots(blocks, root):
        block = torch.compile(block, fullgraph=True, backend=backend)
        block.register_forward_pre_hook(_inputs_not_detached_views, with_kwargs=True)
        setattr(parent, name, block)
        out.append(block)
    return out


def _inputs_not_detached_views(module, args, kwargs):
    """The block's inputs, each that is a view of a tensor outside autograd copied. Under TP
    the first block's input is such a view: `DTensor.to_local()` of the embedding's output
    is a view of the local shard, which itself does not require grad. AOTAutograd (torch
    2.13) replays an input view from its base, so the gradient never reaches the
    embedding: it trained not at all, with no error. One copy of one activation a forward."""
    detached_view = lambda x: (isinstance(x, torch.Tensor) and x.requires_grad and x._base is not None
                               and not x._base.requires_grad)
    if not any(map(detached_view, (*args, *kwargs.values()))):
        return None
    copied = lambda x: x.clone() if detached_view(x) else x
    return tuple(map(copied, args)), {key: copied(x) for key, x in kwargs.items()}


def block_slots(blocks, root: nn.Module | None = None) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, block) for each block, where a wrapper must be put for the
    parent's forward to call it. A wrapper only takes effect in its parent: wrapping a
    block that the model still reaches under its old name changes nothing."""
    if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        return [(blocks, name, block) for name, block in blocks.named_children()]
    if root is None:
        raise ValueError("a list of blocks needs root=, the model they are in, to find each one's parent")
    where = {id(child): (parent, name) for parent in root.modules() for name, child in parent.named_children()}
    missing = [type(b).__name__ for b in blocks if id(b) not in where]
    if missing:
        raise ValueError(f"blocks not found inside {type(root).__name__}: {', '.join(missing)} "
                         "(pass the modules of this model, or their ModuleList)")
    return [(*where[id(b)], b) for b in blocks]
