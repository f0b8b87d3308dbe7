"""Memory-bound passes over the parameters each step, apart from the blocks' compute:
FSDP2's copies around its collectives, gradient clipping and AdamW.

    seconds = fsdp_copy_bytes(params, degree=8, rounds=(2, 1)) / gpu.hbm_bandwidth

They scale with the parameters a GPU holds, not with its tokens: a few percent of a step
with a long local batch, a quarter of one with a short one (one H100, 3.2 B parameters, one
8,192-token sequence: 76 ms of 338; docs/planning.md, Step time).
Byte counts are read from torch's own code (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py, _fsdp_param_group.py, _fsdp_param.py; torch/nn/utils/clip_grad.py;
torch/optim/adamw.py), reads plus writes, at the GPU's measured copy bandwidth
(physics/gpus.py `hbm_bandwidth`, which counts both).

- **each all-gather round** of a unit sharded over several ranks: the fp32 shard cast to
  bf16 into one flat buffer (`_get_param_all_gather_inputs`' foreach copy: read 4, write 2)
  and copied into the all-gather's input (`all_gather_copy_in`: 2 + 2), both over this
  GPU's shard; then the gathered unit copied out into the parameters
  (`split_with_sizes_copy`: 2 + 2) over the whole unit as this GPU holds it (after TP).
  A unit of one rank (one GPU, NO_SHARD's shard groups, experts with ep = dp_shard) takes
  torch's one-rank path instead: each parameter cast (6) and copied into place (4).
- **each reduce-scatter round**: the bf16 gradients concatenated into the fp32 send buffer
  (`chunk_cat`: read 2, write 4) over the whole unit; one rank: then copied to the output
  (4 + 4), divided on the way where a divide factor is set (the experts': 8 more). A
  gradient reduced every micro-batch (no pipeline) is added into the shard's (4 + 4 + 4)
  from the second on.
- **reducing once a step** (a pipeline's stages, or [parallelism] gradient_sync = "step"),
  after the last micro-batch: until then FSDP keeps an fp32 copy of each unsharded gradient
  (`to_accumulated_grad_if_needed`: read 2, write 4 on the first micro-batch;
  `accumulate_unsharded_grad_if_needed`: 2 + 4 + 4 on each other), and the reduce's
  concatenation then reads fp32 (4 + 4).
- **reducing in bf16** ([training] mixed_precision_reduce = "bfloat16", `reduce_bytes` 2):
  each 4 above that is the reduce dtype's becomes 2 (the send buffer, the one-rank copies,
  the held sum, which autograd then accumulates in place as the bf16 gradient itself, with
  no first upcast), and each round casts the reduced shard back to the fp32 parameters'
  dtype (`_to_dtype_if_needed`: read 2, write 4 over the shard).
- **clipping** (parallel/grad_clip.py, torch's foreach kernels): the norm reads every fp32
  gradient shard (4), every step (it is logged); with [training] max_norm > 0 the scale
  reads and writes it (8), clipped or not (torch multiplies by the clamped coefficient).
- **AdamW** (fused): reads parameter, gradient, m and v, writes parameter, m and v (fp32): 28.

Copy-in and chunk_cat run on FSDP's side streams; they are counted as if serial, as the
H100 profile shows the one-rank path: its kernels' self times add up to the step's wall
time. That profile (one GPU) is the only measurement: the counts for units over several
ranks are torch's code read, not timed. Not counted: float8 all-gather's casts (torchao's
pre-all-gather; charged here at the bf16 rates). Under FULL_SHARD without a pipeline the
embedding and the head are gathered once a micro-batch, the blocks twice: step_time passes
the rounds weighted by their parameters (planning/step_time.py gathered_once).
"""

from __future__ import annotations

GATHER_SHARD_BYTES = 6 + 4   # cast fp32 -> bf16, then copy into the all-gather input
GATHER_UNIT_BYTES = 2 + 2    # copy the gathered unit out into the parameters
ONE_RANK_GATHER_BYTES = 6 + 4  # one rank: cast, then copy into the unsharded parameter
GRAD_BYTES, MASTER_BYTES = 2, 4  # a bf16 gradient as backward makes it; the fp32 shard's dtype
SHARD_ACCUMULATE_BYTES = 4 + 4 + 4  # a reduced gradient added into the shard's
NORM_BYTES = 4               # foreach_norm: every step, for the logged gradient norm
SCALE_BYTES = 8              # foreach_mul_: when clipping ([training] max_norm > 0)
ADAMW_BYTES = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v (fp32)


def reduce_pass_bytes(r: int) -> dict[str, int]:
    """Bytes per element of each pass around a reduction in a dtype of ``r`` bytes (4: fp32,
    the module docstring's counts; 2: bf16)."""
    return dict(
        unit=GRAD_BYTES + r,                      # chunk_cat: bf16 gradients into the send buffer
        accumulated=r + r,                        # chunk_cat of gradients summed over micro-batches
        one_rank=r + r,                           # one rank: the send buffer copied to the output
        divide=r + r,                             # ... through a divided temporary
        first=GRAD_BYTES + r if r != GRAD_BYTES else 0,  # reducing once: the first gradient's copy
        add=GRAD_BYTES + r + r,                   # each later one added into the sum
        cast=r + MASTER_BYTES if r != MASTER_BYTES else 0,  # the reduced shard cast back to fp32
    )


def fsdp_copy_bytes(params: float, degree: int, rounds: tuple[int, int], *, trainable: float = 1.0,
                    microbatches: int = 1, reduces_once: bool = False, divided: bool = False,
                    reduce_bytes: int = 4) -> float:
    """Bytes FSDP2's copies move on one GPU per step for units of ``params`` parameters (as
    this GPU holds them, after TP) sharded over ``degree`` ranks, gathered and reduced
    ``rounds`` = (all-gathers, reduce-scatters) times per step (planning/step_time.py
    fsdp_rounds), with ``microbatches`` forwards per step. Only the ``trainable`` fraction
    has gradients ([lora]: the frozen base is gathered, never reduced). ``reduces_once``: the
    gradients accumulate unsharded and reduce once (a pipeline, gradient_sync = "step");
    ``divided``: the units divide their gradients by a factor of their own (the experts');
    ``reduce_bytes``: the reduce dtype's size (Job.reduce_bytes)."""
    n_ag, n_rs = rounds
    shard = params / degree
    r = reduce_pass_bytes(reduce_bytes)
    if degree == 1:
        gather = ONE_RANK_GATHER_BYTES * params
        reduce = r["one_rank"] + (r["divide"] if divided else 0)
    else:
        gather = GATHER_SHARD_BYTES * shard + GATHER_UNIT_BYTES * params
        reduce = 0
    cast = r["cast"] * n_rs * shard
    if reduces_once:
        reduce += r["accumulated"]
        grads = (r["first"] + r["add"] * (microbatches - 1) + reduce * n_rs) * params + cast
    else:
        grads = (r["unit"] + reduce) * n_rs * params + SHARD_ACCUMULATE_BYTES * max(n_rs - 1, 0) * shard + cast
    return n_ag * gather + trainable * grads


def clip_bytes(sharded: float, clip: bool = True) -> float:
    """Bytes the gradient norm, and with ``clip`` the scaling, move over ``sharded``
    gradient shards (the trainable parameters')."""
    return (NORM_BYTES + (SCALE_BYTES if clip else 0)) * sharded


def adamw_bytes(sharded: float) -> float:
    """Bytes one fused AdamW step moves over ``sharded`` parameter shards (those AdamW
    updates: the trainable ones, less Muon's matrices under [optimizer] name = "Muon")."""
    return ADAMW_BYTES * sharded
