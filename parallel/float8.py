"""Float8 training of the Linear layers, through torchao (an optional dependency).

`convert_to_float8_training` swaps each chosen nn.Linear for torchao's Float8Linear, which
casts its input, weight and output gradient to float8 with dynamic scales for the three
matmuls of forward and backward; the weights themselves (and FSDP's fp32 master copies)
stay in high precision, so nothing else in the trainer changes. Convert before TP and
FSDP, which then shard the converted modules' weights as usual.

Recipes (torchao's names): ``tensorwise`` -- one scale per tensor, the fastest, and the one
whose casts can move before a collective: under TP the sequence all-gather in front of
attention and the MLP then carries float8 (`float8_tp_plan`, torchao's float8 TP styles),
and with ``enable_fsdp_float8_all_gather`` FSDP gathers the weights in float8 (half the
bf16 bytes; the scales of all weights computed in one all-reduce at the start of each
step, `precompute_float8_scales`). ``rowwise`` -- one scale per row, more accurate with
outliers; its casts happen after the collectives (bf16 all-gathers), so TP runs with the
plain styles.

The output projection is left in high precision, as float8 recipes usually do: its
logits go straight into the loss (and a tied one shares its weight with the embedding,
which a float8 swap would untie). Layers whose sizes are not multiples of 16 are left
too: float8 matmul kernels require it.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from torch import nn

PIP_PACKAGE = "torchao"


RECIPES = ("tensorwise", "rowwise")


def float8_unavailable(device_type: str) -> str | None:
    """Why float8 training cannot run here, naming every missing piece; None when it can.
    On CPU it runs on torch's reference float8 matmul: right numbers, no speed (the tests
    run there)."""
    missing = []
    if importlib.util.find_spec("torchao") is None:
        missing.append(f"torchao is not installed (pip install {PIP_PACKAGE})")
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        missing.append(f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; float8 "
                       "matmuls need >= 8.9 (H100, H200, L4...)")
    return "; ".join(missing) or None


def float8_config(recipe: str = "tensorwise", fsdp_float8_all_gather: bool = False):
    """torchao's Float8LinearConfig for a recipe name, with FSDP's float8 all-gather if asked
    (tensorwise only: a row's scale needs the whole row, which only the all-gather brings)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r}: accepted {', '.join(RECIPES)}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"enable_fsdp_float8_all_gather needs recipe = \"tensorwise\" (got {recipe!r}): a "
                         "rowwise scale needs the whole row, which only the all-gather brings")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def apply_float8(model: nn.Module, skip: tuple[str, ...] = (), recipe: str = "tensorwise",
                 fsdp_float8_all_gather: bool = False) -> list[str]:
    """Convert ``model``'s Linear layers to float8 training, except those named in ``skip``
    (module names: the output head, which each family names in models/registry.py), those whose weight is
    tied to another module, and those with a size not divisible by 16. Works on a
    meta-device model. Returns the names of the converted layers."""
    reason = float8_unavailable("cuda" if torch.cuda.is_available() else "cpu")
    if reason:
        raise ValueError(f"float8 training: {reason}")
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, fsdp_float8_all_gather)

    converted = []
    seen, tied = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(id(param))

    def wanted(module: nn.Module, name: str) -> bool:
        ok = (isinstance(module, nn.Linear) and name not in skip and id(module.weight) not in tied
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=wanted)
    return converted


def float8_tp_plan(model: nn.Module, plan: dict, device_type: str) -> dict:
    """``plan`` with the styles of tensorwise float8 layers swapped for torchao's float8 TP
    styles: a Linear's input is cast to float8 before its sequence all-gather (half the
    bytes), and a module whose inputs are redistributed for float8 layers (attention, the
    MLP) casts once for all of them. Rowwise layers and high-precision ones keep their styles,
    and so does every layer off CUDA: gloo has no float8 collectives, so there the casts
    come after the (high-precision) gathers -- the same numbers, twice the bytes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    if "torchao.float8" not in sys.modules:  # nothing was converted (and a TP run need not import torchao)
        return plan
    gathers_float8 = {name for name, m in model.named_modules() if _tensorwise_float8(m)}
    if not gathers_float8 or device_type != "cuda":
        return plan
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    from meshtrain.parallel.tensor_parallel import plan_key_matches

    paths = [name for name, _ in model.named_modules()]
    out = {}
    for key, style in plan.items():
        matched = [p for p in paths if plan_key_matches(key, p)] if any(c in key for c in "*?[") else [key]
        if type(style) in (ColwiseParallel, RowwiseParallel) and matched and all(p in gathers_float8 for p in matched):
            float8_style = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            out[key] = float8_style(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                    use_local_output=style.use_local_output)
        elif type(style) is PrepareModuleInput and matched and not style.input_kwarg_layouts:
            # Every input redistributed here feeds float8 layers only if all its Linear children are float8.
            children = [f"{p}.{c}" for p in matched for c, m in model.get_submodule(p).named_children()
                        if isinstance(m, nn.Linear)]
            if children and all(c in gathers_float8 for c in children):
                first = children[0].rsplit(".", 1)[1]
                out[key] = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                                    desired_input_layouts=style.desired_input_layouts,
                                                    use_local_output=style.use_local_output,
                                                    fwd_config_submodule_fqn=first)
            else:
                out[key] = style
        else:
            out[key] = style
    return out


def _tensorwise_float8(module: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    return (isinstance(module, Float8Linear)
            and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)


def precompute_float8_scales(modules: list[nn.Module]) -> None:
    """Before a step, with FSDP's float8 all-gather: every weight's float8 scale from one
    all-reduce of all their maxima (over the whole weight, as one process would scale it),
    instead of one per layer inside the forward's all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for module in modules:
        precompute_float8_dynamic_scale_for_fsdp(module)
