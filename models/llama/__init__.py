from models.llama.model import FLAVORS, Llama, LlamaConfig

__all__ = ["FLAVORS", "Llama", "LlamaConfig"]
