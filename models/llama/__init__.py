"""Llama 2/3. `FLAVORS` and `LlamaConfig` need no torch; `Llama` (the module) is imported
on first use, so that reading a run config never loads torch."""

from meshtrain.models.llama.config import FLAVORS, LlamaConfig

__all__ = ["FLAVORS", "LlamaConfig", "Llama"]


def __getattr__(name: str):
    if name == "Llama":
        from meshtrain.models.llama.model import Llama
        return Llama
    raise AttributeError(f"module 'models.llama' has no attribute {name!r}")
