"""Float8 training of the Linear layers, through torchao (an optional dependency).

`convert_to_float8_training` swaps each chosen nn.Linear for torchao's Float8Linear, which
casts its input, weight and output gradient to float8 with dynamic per-tensor scales for
the three matmuls of forward and backward; the weights themselves (and FSDP's fp32 master
copies) stay in high precision, so nothing else in the trainer changes. Convert before
FSDP, which then shards the converted modules' weights as usual (TP is refused for now).

The output projection is left in high precision, as float8 recipes usually do: its
logits go straight into the loss (and a tied one shares its weight with the embedding,
which a float8 swap would untie). Layers whose sizes are not multiples of 16 are left
too: float8 matmul kernels require it.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

PIP_PACKAGE = "torchao"


def float8_unavailable(device_type: str, tp: int = 1) -> str | None:
    """Why float8 training cannot run here, naming every missing piece; None when it can."""
    missing = []
    if importlib.util.find_spec("torchao") is None:
        missing.append(f"torchao is not installed (pip install {PIP_PACKAGE})")
    if device_type != "cuda" or not torch.cuda.is_available():
        missing.append(f"it needs a CUDA GPU with compute capability >= 8.9 (H100, H200, L4...); "
                       f"this run is on {device_type}")
    elif torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        missing.append(f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; float8 "
                       "matmuls need >= 8.9 (H100, H200, L4...)")
    if tp > 1:
        # torchao's float8 tensor parallelism needs its own TP styles, which our plans do not use.
        missing.append(f"float8 with tensor parallelism (tp = {tp}) is not supported yet; use tp = 1")
    return "; ".join(missing) or None


def apply_float8(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Convert ``model``'s Linear layers to float8 training, except those named in ``skip``
    (module names: the output head, which each family names in models/registry.py), those whose weight is
    tied to another module, and those with a size not divisible by 16. Works on a
    meta-device model. Returns the names of the converted layers."""
    reason = float8_unavailable("cuda" if torch.cuda.is_available() else "cpu")
    if reason:
        raise ValueError(f"float8 training: {reason}")
    from torchao.float8 import convert_to_float8_training

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

    convert_to_float8_training(model, module_filter_fn=wanted)
    return converted
