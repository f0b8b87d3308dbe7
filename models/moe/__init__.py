"""Mixture-of-experts transformers (DeepSeek-V3 / Qwen3-MoE shapes). `FLAVORS` and
`MoEConfig` need no torch; `MoETransformer` (the module) is imported on first use."""

from meshtrain.models.moe.config import FLAVORS, MoEConfig

__all__ = ["FLAVORS", "MoEConfig", "MoETransformer"]


def __getattr__(name: str):
    if name == "MoETransformer":
        from meshtrain.models.moe.model import MoETransformer
        return MoETransformer
    raise AttributeError(f"module 'models.moe' has no attribute {name!r}")
