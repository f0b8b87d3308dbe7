"""The layout of a run: how its GPUs split the work (the degrees of the mesh) and how each
step runs on them (FSDP strategy, activation checkpointing, micro-batches, pipeline).

    dims = ParallelDims(dp_shard=-1, tp=2)           # degrees alone: enough to build a mesh
    mesh = dims.build_mesh()

One type for every layout: training/recipe.py resolves a config into one (every default
filled, every rule checked), the planner's search enumerates them (planning/search.py), and
the planner estimates the trainer's own (planning/estimate.py) without copying a field.
parallelize() takes the step's settings as arguments, so a mesh built by hand needs only
the degrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh

from meshtrain.parallel.expert_parallel import check_ep_fits
from meshtrain.parallel.mesh import LayoutError, build_device_mesh, check_tp_fits, launched_world_size
from meshtrain.parallel.vocabulary import DIM_NAMES, placement


@dataclass
class ParallelDims:
    """Degrees of each parallelism (``dp_shard=-1`` takes whatever the others leave), and
    how a step runs on them."""

    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1                    # expert parallelism: ranks borrowed from dp_shard (parallel/expert_parallel.py)
    world_size: int | None = None  # default: the launched world (WORLD_SIZE)
    # How each step runs (parallel/vocabulary.py has the accepted values).
    strategy: str = "FULL_SHARD"   # the FSDP sharding strategy, resolved ("auto" never stays)
    ac: str = "none"               # activation checkpointing mode
    micro_batch: int = 1           # sequences per forward; under a pipeline, per micro-batch
    # When accumulated gradients are reduced, "microbatch" or "step" (parallel/vocabulary.py
    # GRADIENT_SYNC); a pipeline always reduces once a step (`reduces_once`).
    gradient_sync: str = "microbatch"
    pp_schedule: str = "1F1B"      # the pipeline's; 1F1B without one
    pp_microbatches: int = 1       # micro-batches per pass through the pipeline; 1 without one
    stages_per_rank: int = 1       # virtual pipeline stages per pp rank
    # The layers of each pipeline stage as training/recipe.py cut them for the model; None
    # without a pipeline, and for the planner's candidates, which are split evenly
    # (planning/shares.py). It follows from the fields above and the model, so two layouts
    # are the same whether or not it has been filled in.
    stage_layers: list[list[int]] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.world_size is None:
            self.world_size = launched_world_size()
        problems = []
        for name in DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(f"{name}={value!r} must be an integer")
            elif value < 1 and not (name == "dp_shard" and value == -1):
                accepted = ">= 1, or -1 to infer" if name == "dp_shard" else ">= 1"
                problems.append(f"{name}={value} must be {accepted}")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            problems.append(f"ep={self.ep!r} must be an integer >= 1")
        if problems:
            raise LayoutError("invalid parallel degrees: " + "; ".join(problems))

        others = self.pp * self.dp_replicate * self.cp * self.tp
        cp = f"*{self.cp}" if self.cp > 1 else ""
        cp_name = "*cp" if self.cp > 1 else ""
        if self.dp_shard == -1:
            if self.world_size % others:
                raise LayoutError(
                    f"cannot infer dp_shard: world size {self.world_size} is not divisible by "
                    f"pp*dp_replicate{cp_name}*tp = {self.pp}*{self.dp_replicate}{cp}*{self.tp} = {others}"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise LayoutError(
                f"parallel degrees do not multiply to the world size: pp*dp_replicate*dp_shard{cp_name}*tp = "
                f"{self.pp}*{self.dp_replicate}*{self.dp_shard}{cp}*{self.tp} = {product}, "
                f"but the world size is {self.world_size}"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards over: dp_shard x cp (cp ranks hold the same weights)."""
        return self.dp_shard * self.cp

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def reduces_once(self) -> bool:
        """Gradients reduced once a step, after the last micro-batch, with each unit's
        gathered weights and unsharded fp32 gradient sum held until then: always under a
        pipeline (torch's PipelineStage), by choice without one (gradient_sync = "step")."""
        return self.pp > 1 or self.gradient_sync == "step"

    @property
    def placement(self) -> str:
        """How pipeline stages land on the pp ranks: "loop" or "v" (parallel/pipeline.py)."""
        return placement(self.pp_schedule)

    @property
    def local_batch(self) -> int:
        """Sequences one rank runs per forward pass: one micro-batch, or under a pipeline the
        micro-batches one pass through it carries."""
        return self.micro_batch * (self.pp_microbatches if self.pp > 1 else 1)

    def grad_accum(self, global_batch: int) -> int:
        """Forward/backward passes of `local_batch` sequences per optimizer step."""
        return global_batch // (self.dp * self.local_batch)

    def check_model(self, divisible: dict[str, int], *, seq_len: int | None = None,
                    sequence_parallel: bool = True, gpus_per_node: int | None = None) -> None:
        """Check this layout against a model (see `check_tp_fits`)."""
        check_tp_fits(self.tp, divisible, seq_len=seq_len, sequence_parallel=sequence_parallel,
                      gpus_per_node=gpus_per_node)

    def ep_problems(self, ep_divisible: dict[str, int] | None, strategy: str | None = None) -> list[str]:
        """What stops ``ep`` on this layout and model (``ep_divisible``: what ep splits, None
        for a model without experts; ``strategy``: the resolved FSDP strategy); [] if nothing."""
        problems = check_ep_fits(self.ep, dp_shard=self.dp_shard, divisible=ep_divisible,
                                 dp_replicate=self.dp_replicate, cp=self.cp)
        strategy = strategy or self.strategy
        if self.ep > 1 and strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            problems.append(f"ep={self.ep} shards expert weights with FSDP over dp_shard / ep, which "
                            f"sharding_strategy {strategy} does not do: use FULL_SHARD or SHARD_GRAD_OP")
        return problems

    def build_mesh(self, device_type: str | None = None, timeout_seconds: float | None = None) -> DeviceMesh:
        """Initialize the process group if needed and build the mesh of these degrees
        (parallel/mesh.py, `build_device_mesh`: degree-1 dimensions are left out)."""
        return build_device_mesh(self.degrees, self.world_size, device_type, timeout_seconds)
