"""The words a layout is described in, each said once: mesh dimensions, FSDP sharding
strategies, activation checkpointing modes, pipeline schedules.

The config's accepted values (training/config.py, and from it docs/config.md), the checks
of parallel/ and the planner's search all read them from here. No torch: a config is read
and checked before torch is imported.
"""

# The mesh, outermost first (parallel/mesh.py says why in this order).
DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# FSDP2 under the sharding-strategy names FSDP1 and DeepSpeed users know, with the ZeRO
# stage each is (parallel/fsdp.py): 3 frees a unit's gathered parameters after its forward
# and gathers them again for its backward; 2 keeps them gathered from forward to backward;
# 0 (NO_SHARD) shards nothing. The HYBRID_* forms also replicate over dp_replicate.
STRATEGIES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2}

# none; full: every block recomputed in backward; selective: every selective_every-th
# block; op: every block, keeping matmul, attention and collective outputs
# (parallel/activation_checkpoint.py).
AC_MODES = ("none", "full", "selective", "op")

# When gradient accumulation reduces: after every micro-batch's backward (FSDP2's default:
# the sharded gradients accumulate, nothing unsharded is held between micro-batches), or
# once a step, after the last (DDP's and FSDP1's no_sync, Megatron's and DeepSpeed ZeRO-1's
# way, and what torch's PipelineStage always does: each unit's fp32 gradient sum and its
# gathered weights held from one micro-batch to the next; parallel/fsdp.py hold_gradients).
GRADIENT_SYNC = ("microbatch", "step")


# torch.distributed.pipelining's schedules: name -> (stages per rank: "one", "any" or the
# exact number; placement: "loop" puts stage s on rank s % pp, "v" goes down the ranks and
# back up; whole_backward: torch's plan of each rank is forwards and whole backwards only,
# which the dry run replays and the planner models -- the zero-bubble ones split a
# backward into its input and weight parts).
SCHEDULES = {
    "GPipe": ("one", "loop", True),
    "1F1B": ("one", "loop", True),
    "Interleaved1F1B": ("any", "loop", True),
    "LoopedBFS": ("any", "loop", True),
    "InterleavedZeroBubble": ("any", "loop", False),
    "ZBVZeroBubble": (2, "v", False),
    "DualPipeV": (2, "v", False),
}
WHOLE_BACKWARD = tuple(name for name, (_, _, whole) in SCHEDULES.items() if whole)


def default_stages_per_rank(schedule: str) -> int:
    return 1 if SCHEDULES[schedule][0] == "one" else 2


def placement(schedule: str) -> str:
    return SCHEDULES[schedule][1]
