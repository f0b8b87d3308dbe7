"""GPT-2 / GPT-3. `FLAVORS` and `GPT2Config` need no torch; `GPT2` (the module) is imported
on first use, as in models/llama."""

from meshtrain.models.gpt2.config import FLAVORS, GPT2Config

__all__ = ["FLAVORS", "GPT2Config", "GPT2"]


def __getattr__(name: str):
    if name == "GPT2":
        from meshtrain.models.gpt2.model import GPT2
        return GPT2
    raise AttributeError(f"module 'models.gpt2' has no attribute {name!r}")
