"""Planning on a laptop: how much memory, time and traffic a layout needs before any GPU
is allocated.

    python -m planning.plan --model 70B --nodes 8 --gpu h100-80gb ...   # rank layouts (cost.py's model)
    python train.py --config X --dry-run --world-size N                  # trace one rank's real step

hardware.py holds the GPUs (peak compute, memory, links), cost.py the closed-form
estimates, plan.py the layout search, dry_run.py the traced step on a fake process group.
"""
