#!/usr/bin/env bash
# Install meshtrain and its test tools into the current Python environment.
# An already-installed torch (e.g. a CUDA build on a GPU machine) is kept as it is;
# only a machine without torch gets torch 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
# The trackers' extras too: tests/test_trackers.py runs each against its real package;
# and peft: tests/test_lora.py proves [lora] against PEFT's own LoRA; and torchft:
# tests/test_fault_tolerance.py kills and restarts a replica group under its lighthouse.
"$PY" -m pip install --quiet -e ".[dev,lora,wandb,mlflow,trackio,float8,ft]"
"$PY" -c "import torch; print(f'meshtrain ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
