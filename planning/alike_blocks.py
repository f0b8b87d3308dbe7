"""Trace three of a stage's alike blocks, not all of them, and expand what they issue.

A 405B stage holds 7 or 8 of the 126 blocks; the collective check traced every one on
every traced rank: most of its time at 512 ranks. Blocks that are alike -- the same
classes, plain attributes, hooks, parameter and buffer shapes (`signature`) -- run the
same code on the same shapes, so each issues the same collectives, except where a block
is next to something else: FSDP gathers the first block to run backward itself and each
other block is prefetched by the one after it; the stage's embedding and head come before
and after. What a block issues depends on its position only through its neighbours.

So a stretch ("run") of n > 3 alike blocks of a stage is built with its first three and
traced: the first, one middle block, the last (`collapse`). Every collective is tagged
with the block it was issued for (`BlockTags`): the block whose forward, recomputation or
backward is running, else the block whose FSDP group the call belongs to (a pipeline
stage reduces its gradients after the step's last backward, outside any block). In each
group's sequence, each stretch of the middle block's calls stands for every middle block
of the run: it is repeated n - 2 times (`expand`). docs/dry_run.md argues it;
tests/test_collective_check.py checks the expanded sequences equal tracing every block,
call for call, on nine layouts, and that a block unlike the others is traced.

Selective activation checkpointing wraps every k-th block of a stage, so there a unit of
k blocks is the alike element (`collapse(periodic=True)`: the collective check; the
memory extrapolation of planning/alike_memory.py does not collapse it). Not collapsed:
blocks in a ModuleList (Hugging Face models: their forward slices the list by the
config's depth).
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

KEEP = 3  # first, middle, last


def signature(block: nn.Module) -> list:
    """What a block's program can depend on besides its inputs: its modules' classes,
    plain attributes (a layer index a forward might branch on), hook counts, and its
    parameters' and buffers' names, shapes and dtypes."""
    plain = (int, float, str, bool, type(None), tuple)
    out = []
    for name, m in block.named_modules():
        attrs = sorted((k, v) for k, v in vars(m).items() if not k.startswith("_")
                       and (isinstance(v, plain) or dataclasses.is_dataclass(v)))
        hooks = [len(getattr(m, h)) for h in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                                               "_backward_pre_hooks")]
        params = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)]
        buffers = [(n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False)]
        out.append((name, type(m), attrs, hooks, params, buffers))
    return out


def collapse(cfg, model: nn.Module, layout, *, longer_than: int = KEEP, grow: tuple | None = None,
             only_if=lambda real: True, periodic: bool = False):
    """(the layout to build with, {block name: (stage, run, position)} of the blocks kept,
    {(stage, run): its real number of blocks}). A run is a stretch of a stage's blocks that
    are alike; each run of more than ``longer_than`` keeps its first KEEP, the run ``grow``
    (stage, run) one more (the memory extrapolation's second depth, planning/alike_memory.py),
    if ``only_if(real)`` says so. The model loses the blocks no stage keeps (on meta:
    nothing is freed or copied); ``layout`` is left as it is.

    Selective checkpointing wraps every k-th block of a stage (k = selective_every), so
    alike blocks differ by position; with ``periodic`` (the collective check), a unit of k
    blocks is what repeats: a run that starts at a unit and holds whole units keeps its
    first KEEP units, positions and lengths count units, and every block keeps the place
    in its stage, so the same blocks are wrapped. Other runs are kept whole."""
    blocks = getattr(model, "transformer_blocks", lambda: None)()
    selective = cfg.activation_checkpoint.mode == "selective"
    if not isinstance(blocks, nn.ModuleDict) or (selective and not periodic):
        return layout, {}, {}
    k = cfg.activation_checkpoint.selective_every if selective else 1
    assert k == 1 or grow is None, "the memory extrapolation does not collapse selective checkpointing"
    stages = layout.stage_layers or [[int(b) for b in blocks]]
    kept, tags, real = [], {}, {}
    for s, ids in enumerate(stages):
        runs = []  # (signature, ids)
        for i in ids:
            sig = signature(blocks[str(i)])
            if runs and runs[-1][0] == sig:
                runs[-1][1].append(i)
            else:
                runs.append((sig, [i]))
        kept.append([])
        for r, (_, run) in enumerate(runs):
            if len(run) > longer_than * k and len(kept[-1]) % k == 0 and len(run) % k == 0:
                real[s, r] = len(run) // k
                run = run[:(KEEP + ((s, r) == grow)) * k]
                tags.update({str(i): (s, r, j // k) for j, i in enumerate(run)})
            kept[-1] += run
    if not real or not only_if(real):
        return layout, {}, {}
    if layout.stage_layers is None:
        for name in [k for k in blocks if int(k) not in kept[0]]:
            del blocks[name]
        return layout, tags, real
    built = copy.copy(layout)
    built.stage_layers = kept
    return built, tags, real


class BlockTags:
    """Tags each collective with (stage, run, position) of the kept block it is issued for
    (see the module docstring), or None outside the collapsed runs' blocks."""

    def __init__(self, parts, tags: dict[str, tuple]):
        # block module (as wrapped) -> (stage, run, position); the stage's ModuleDict keeps
        # the whole model's block names
        self.of = {block: tags[name] for _, part in parts if tags
                   for name, block in part.transformer_blocks().items() if name in tags}
        self.running, self.owner, self.last = [], [], None

    def current(self):
        if self.running:
            return self.running[-1]
        return self.owner[-1] if self.owner else None

    def latest(self):
        """The current tag, or else the last one there was: what runs between two blocks
        (hooks, the next block's gather) belongs to the block before, so a middle block's
        stretch of memory events repeats whole with each middle block."""
        tag = self.current()
        if tag is not None:
            self.last = tag
        return self.last

    def __enter__(self):
        from torch.distributed._tools.mod_tracker import ModTracker
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        def enter(module, *_):
            if module in self.of:
                self.running.append(self.of[module])

        def leave(module, *_):
            # Backward: a block's "leave" (its inputs' gradients ready) comes after the
            # next block's "enter" (the same tensor's gradient): remove this block's tag.
            if module in self.of and self.of[module] in self.running:
                del self.running[len(self.running) - 1 - self.running[::-1].index(self.of[module])]

        self.tracker = ModTracker()
        self.tracker.register_user_hooks(enter, leave, enter, leave)
        self.tracker.__enter__()
        self.originals = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "post_backward")}
        for name, method in self.originals.items():
            setattr(FSDPParamGroup, name, self._owned(method))
        return self

    def __exit__(self, *exc):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        for name, method in self.originals.items():
            setattr(FSDPParamGroup, name, method)
        self.tracker.__exit__(*exc)

    def _owned(self, method):
        def owned(group, *args, **kwargs):
            self.owner.append(next((self.of[m] for m in group.modules if m in self.of), None))
            try:
                return method(group, *args, **kwargs)
            finally:
                self.owner.pop()
        return owned


def expand(calls: list, tags: list, real: dict[tuple, int]) -> list:
    """The sequence the real stages issue: each stretch of consecutive calls of a middle
    block, once per middle block of its real run of alike blocks."""
    out, i = [], 0
    while i < len(calls):
        tag = tags[i]
        if tag is None or tag[2] in (0, KEEP - 1):
            out.append(calls[i])
            i += 1
            continue
        j = i
        while j < len(calls) and tags[j] == tag:
            j += 1
        out += calls[i:j] * (real[tag[:2]] - KEEP + 1)
        i = j
    return out
