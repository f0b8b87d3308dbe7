"""What a config.json may say that transformers accepts when it reads the config but cannot
run: checked when the model is built (before any process group), so the user gets the key
and the file instead of a KeyError or a shape mismatch from inside the first forward.

- a RoPE type (`rope_scaling` / `rope_parameters`, "rope_type" or the older "type") that
  this transformers has no implementation for: its rotary class looks the type up in
  ROPE_INIT_FUNCTIONS and fails with a bare KeyError;
- key/value heads that do not divide the attention heads: grouped-query attention repeats
  each key/value head num_attention_heads / num_key_value_heads times, and a remainder
  surfaces as a shape error in attention;
- ``output_router_logits = true`` on a mixture of experts: transformers then adds its router
  auxiliary loss to the loss it returns when given labels; meshtrain computes the
  cross-entropy itself from the logits, so the setting would be silently ignored
  (docs/moe.md, Hugging Face mixtures of experts).
"""

from __future__ import annotations

# The config.json keys a RoPE type is read from, older spelling last (transformers 5
# moves rope_scaling into rope_parameters as it reads the config).
_ROPE_KEYS = ("rope_parameters", "rope_scaling")


def file_problem(config_class, hf: dict, path: str) -> str | None:
    """What is wrong in ``hf`` (the file's dict, at ``path``) for ``config_class``, found
    before transformers reads it (which would only log a warning about it), or None."""
    return _rope_problem(config_class, hf, path)


def config_problem(config, hf: dict, path: str) -> str | None:
    """Why the transformers ``config`` built from ``hf`` cannot run, naming the key and the
    file; None when nothing is wrong."""
    return _heads_problem(config, hf, path) or _router_loss_problem(config, path)


def _rope_types(rope: dict) -> list[str]:
    """The RoPE types one rope dict names: itself, or one per layer type (Gemma3's
    {"full_attention": {...}, "sliding_attention": {...}})."""
    if not isinstance(rope, dict):
        return []
    if any(isinstance(v, dict) for v in rope.values()):
        return [t for v in rope.values() if isinstance(v, dict) for t in _rope_types(v)]
    kind = rope.get("rope_type", rope.get("type"))
    return [kind] if isinstance(kind, str) else []


def _rope_problem(config_class, hf: dict, path: str) -> str | None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    own = getattr(config_class, "default_rope_type", "default")  # e.g. an axial RoPE as the default
    known = {"default", own, *ROPE_INIT_FUNCTIONS}
    for key in _ROPE_KEYS:
        unknown = [t for where in (hf, hf.get("text_config") or {}) for t in _rope_types(where.get(key))
                   if t not in known]
        if unknown:
            import transformers

            return (f'{path}: {key} has rope type "{unknown[0]}", which transformers {transformers.__version__} '
                    f"does not implement (it knows {', '.join(sorted(known))}); correct \"rope_type\" in {key}, "
                    f"or upgrade transformers if the model needs a newer one")
    return None


def _heads_problem(config, hf: dict, path: str) -> str | None:
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv, int):
        return None  # an architecture that names its heads otherwise: transformers checks it
    if heads < 1 or kv < 1:
        return f"{path}: num_attention_heads = {heads}, num_key_value_heads = {kv}: both must be at least 1"
    if heads % kv:
        return (f"{path}: num_key_value_heads = {kv} does not divide num_attention_heads = {heads}; each "
                f"key/value head serves a whole group of attention heads, so use a divisor of {heads} "
                f"({', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})")
    return None


def _router_loss_problem(config, path: str) -> str | None:
    text = config.get_text_config()
    if getattr(text, "output_router_logits", False) is not True:
        return None
    coef = getattr(text, "router_aux_loss_coef", None)
    return (f"{path}: output_router_logits = true asks for transformers' router auxiliary loss (router_aux_loss_coef "
            f"= {coef}), which meshtrain does not add: it trains the cross-entropy alone, as transformers does by "
            "default; set output_router_logits to false")
