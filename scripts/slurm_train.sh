#!/usr/bin/env bash
# Multi-node launch on SLURM: one launcher (torchrun, through `meshtrain train`) per node,
# c10d rendezvous on the first node.
#   sbatch --nodes=8 scripts/slurm_train.sh --config llama70b_2d
#SBATCH --job-name=meshtrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun meshtrain train \
  --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:29500" \
  "$@"
