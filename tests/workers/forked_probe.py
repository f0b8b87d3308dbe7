"""A job for tests/test_forked_ranks.py: each rank all-reduces its rank and prints what it
got; with FAIL_RANK set, that rank raises first and the others sleep for ten minutes, which
only a launcher that stops them cuts short."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("FAIL_RANK"):
    if os.environ["FAIL_RANK"] != str(rank):
        print(f"rank {rank} pid {os.getpid()} sleeps", flush=True)
    dist.barrier()  # the pids are out before the failure
    if os.environ["FAIL_RANK"] == str(rank):
        raise RuntimeError(f"rank {rank} fails on purpose")
    time.sleep(600)
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"rank {rank} of {dist.get_world_size()} (local {os.environ['LOCAL_RANK']}): sum {int(total.item())} "
      f"argv {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
