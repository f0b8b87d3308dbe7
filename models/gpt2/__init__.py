from models.gpt2.model import FLAVORS, GPT2, GPT2Config

__all__ = ["FLAVORS", "GPT2", "GPT2Config"]
