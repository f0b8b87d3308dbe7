"""Memory-bound passes over the parameters each step, apart from the blocks' compute:
FSDP2's copies around its collectives, gradient clipping and AdamW.

    seconds = fsdp_copy_bytes(local, sharded, rounds=(2, 1)) / gpu.hbm_bandwidth

They scale with the parameters a GPU holds, not with its tokens: a few percent of a step
with a long local batch, a quarter of one with a short one (one H100, 3.2 B parameters, one
8,192-token sequence: 84 ms of 345; docs/planning.md, Step time).
Byte counts are read from torch's own code (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py, torch/nn/utils/clip_grad.py, torch/optim/adamw.py), reads plus writes,
at the GPU's measured copy bandwidth (physics/gpus.py `hbm_bandwidth`, which counts both).

- **each all-gather round** of a unit: the fp32 shard cast to bf16 into one flat buffer
  (`_get_param_all_gather_inputs`' foreach copy: read 4, write 2), copied into the
  all-gather's input (`all_gather_copy_in`: 2 + 2), both over this GPU's shard; then the
  gathered unit copied out into the parameters (`split_with_sizes_copy`: 2 + 2) over the
  whole unit as this GPU holds it (after TP).
- **each reduce-scatter round**: the bf16 gradients concatenated into the fp32 send buffer
  (`chunk_cat`: read 2, write 4) over the whole unit.
- **clipping** (parallel/grad_clip.py, torch's foreach kernels): the norm reads every fp32
  gradient shard (4), every step (it is logged); with [training] max_norm > 0 the scale
  reads and writes it (8), clipped or not (torch multiplies by the clamped coefficient).
- **AdamW** (fused): reads parameter, gradient, m and v, writes parameter, m and v (fp32): 28,
  with the step's bookkeeping 32.

Copy-in and chunk_cat run on FSDP's side streams; they are counted as if serial, as the
H100 profile shows them: its kernels' self times add up to the step's wall time.
Not counted: float8 all-gather's casts (torchao's pre-all-gather), a gradient accumulated
across micro-batches in fp32 (the reduce-scatter output added into the shard: 12 per
shard per extra round).
"""

from __future__ import annotations

GATHER_SHARD_BYTES = 6 + 4   # cast fp32 -> bf16, then copy into the all-gather input
GATHER_UNIT_BYTES = 2 + 2    # copy the gathered unit out into the parameters
REDUCE_UNIT_BYTES = 2 + 4    # chunk_cat: bf16 gradients into the fp32 reduce-scatter input
NORM_BYTES = 4               # foreach_norm: every step, for the logged gradient norm
SCALE_BYTES = 8              # foreach_mul_: when clipping ([training] max_norm > 0)
ADAMW_BYTES = 8 * 4          # read p, g, m, v; write p, m, v (fp32), and the step's bookkeeping


def fsdp_copy_bytes(local: float, sharded: float, rounds: tuple[int, int], trainable: float = 1.0) -> float:
    """Bytes FSDP2's copies move on one GPU per step: ``local`` parameters of its units
    (after TP), ``sharded`` of them its own, ``rounds`` (all-gathers, reduce-scatters) of
    each unit per step (planning/step_time.py fsdp_rounds). Only the ``trainable`` fraction
    has gradients to reduce ([lora]: the frozen base is gathered, never reduced)."""
    n_ag, n_rs = rounds
    return (n_ag * (GATHER_SHARD_BYTES * sharded + GATHER_UNIT_BYTES * local)
            + n_rs * REDUCE_UNIT_BYTES * local * trainable)


def clip_bytes(sharded: float, clip: bool = True) -> float:
    """Bytes the gradient norm, and with ``clip`` the scaling, move over ``sharded``
    gradient shards (the trainable parameters')."""
    return (NORM_BYTES + (SCALE_BYTES if clip else 0)) * sharded


def adamw_bytes(sharded: float) -> float:
    """Bytes one fused AdamW step moves over ``sharded`` parameter shards (those AdamW
    updates: the trainable ones, less Muon's matrices under [optimizer] name = "Muon")."""
    return ADAMW_BYTES * sharded
