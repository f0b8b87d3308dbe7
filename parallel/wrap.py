"""Which modules become FSDP units, for models that do not list them themselves.

The same two policies FSDP1 users know from `transformer_auto_wrap_policy` and
`size_based_auto_wrap_policy`: wrap every instance of the given block classes, or every
module holding at least `min_num_params` parameters not already claimed by a smaller unit.
"""

from __future__ import annotations

from torch import nn


def modules_to_wrap(model: nn.Module, *, block_classes: tuple[type, ...] | None = None,
                    min_num_params: int | None = None) -> list[nn.Module]:
    """FSDP units in bottom-up order (children before parents), the root excluded."""
    if (block_classes is None) == (min_num_params is None):
        raise ValueError("give exactly one of block_classes (transformer auto-wrap) "
                         "or min_num_params (size-based wrap)")
    if block_classes is not None:
        block_classes = tuple(block_classes)
        units = [m for m in model.modules() if isinstance(m, block_classes) and m is not model]
        if not units:
            names = ", ".join(c.__name__ for c in block_classes)
            raise ValueError(f"no module of class {names} found in {type(model).__name__}")
        return units[::-1] if _nested(units) else units

    units: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(module: nn.Module) -> int:
        # Post-order: a parent only counts parameters its wrapped children left over.
        for child in module.children():
            visit(child)
        own = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        # Containers have no forward, so FSDP cannot hook them (FSDP1's size policy skips
        # them too): their unclaimed parameters fall through to the parent.
        if module is not model and own >= min_num_params and not isinstance(module, _CONTAINERS):
            units.append(module)
            claimed.update(id(p) for p in module.parameters())
        return own

    visit(model)
    return units


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _nested(units: list[nn.Module]) -> bool:
    ids = {id(u) for u in units}
    return any(id(m) in ids for u in units for m in u.modules() if m is not u)
