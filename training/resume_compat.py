"""What may differ between a checkpoint and the run that resumes it, and what makes it
another experiment or another model. Resume refuses a difference (unless [checkpoint]
if_config_differs = "resume"); everything listed here as allowed is not one.

- The job config (job_config.toml): the layout (checkpoints reshard), the length of the
  run, logging, checkpointing and timeouts may change; a key the schema gained or lost
  since the save is no difference.
- The model config (model_config.json): what defines the model. A Hugging Face model's
  config carries library metadata too -- the transformers version that wrote it, the
  storage dtype of the download, attention-kernel and output flags -- which a library
  upgrade rewrites without changing a weight; those are not compared, and neither is a key
  present on one side only (a newer transformers adds or renames attributes as it reads
  the same file).
"""

from __future__ import annotations

# What may change between a run and its resumption without making it another experiment:
# the layout (checkpoints reshard), the length of the run, logging, profiling, checkpointing, timeouts,
# and evaluation -- all but [validation] split, which decides what training reads.
_MAY_CHANGE = {"job": {"name", "output_dir", "description", "device"}, "training": {"steps", "local_batch_size"},
               "parallelism": None, "checkpoint": None, "metrics": None, "comm": None,
               "activation_checkpoint": None, "compile": None, "profiling": None,
               "validation": {"enable", "interval", "steps", "dataset", "dataset_path"}}


def config_differences(saved_toml: str, current_toml: str) -> list[str]:
    """Settings that differ between two configs, except those a resume may change."""
    from meshtrain.training.config_loader import tomllib

    from meshtrain.training.config import JobConfig
    from meshtrain.training.config_loader import config_to_dict

    saved, current = tomllib.loads(saved_toml), tomllib.loads(current_toml)
    # A key the schema has gained since the save stood at its default then; a key it has
    # lost since changes nothing now.
    defaults = config_to_dict(JobConfig())
    found = []
    for section in sorted(current):
        allowed = _MAY_CHANGE.get(section, set())
        if allowed is None:
            continue
        a, b = {**defaults.get(section, {}), **saved.get(section, {})}, current[section]
        for key in sorted(b):
            if key not in allowed and a.get(key) != b[key]:
                found.append(f"[{section}] {key}: {a.get(key)!r} then, {b[key]!r} now")
    return found


# Keys of a transformers config.to_dict() that describe the library or how the model is
# run, not the model: weights written under one are the same weights under another.
LIBRARY_METADATA = frozenset({
    "transformers_version", "_name_or_path", "_commit_hash", "architectures", "dtype", "torch_dtype",
    "use_cache", "attn_implementation", "_attn_implementation", "_attn_implementation_autoset",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript"})


def model_differences(saved: dict, current: dict) -> list[str]:
    """What defines the model and differs between two model_config.json dicts, as
    "field: checkpoint X vs this run Y"; library metadata and one-sided keys are not
    differences (module docstring)."""
    found: list[str] = []
    _compare(saved, current, "", found)
    return found


def _compare(saved, current, prefix: str, found: list[str]) -> None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) & set(current), key=str):
            if key in LIBRARY_METADATA:
                continue
            _compare(saved[key], current[key], f"{prefix}{key}.", found)
    elif saved != current:
        found.append(f"{prefix.rstrip('.')}: checkpoint {saved!r} vs this run {current!r}")
