"""Any Hugging Face causal LM, built from its config.json: `[model] name = "hf"`."""
