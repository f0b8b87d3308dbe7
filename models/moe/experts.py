"""The routed experts: E SwiGLU feed-forwards held as three [E, ...] weights, run over
tokens already sorted by expert.

`GroupedExperts.forward(x_sorted, tokens_per_expert)` is the whole contract: the rows of
``x_sorted`` are token copies grouped by expert (expert 0's first), ``tokens_per_expert[e]``
how many belong to expert e. Dispatch (sorting, and later the all-to-all of expert
parallelism) happens outside, so an expert-parallel style can wrap this module's forward
with hooks that send each group to the rank holding its expert and bring the results
back, while the weights' leading dimension E is the one it splits.

Each projection is a grouped matmul: `torch._grouped_mm` where it has a kernel (CUDA in
bfloat16, CPU in float32; 16-byte aligned rows), else a loop over the experts' contiguous
slices (bench/moe_grouped_mm.py measures the three ways on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [T, in], in groups of ``tokens_per_expert`` [E], each times its expert's
    ``weight[e]`` [out, in] transposed (as nn.Linear stores it) -> [T, out]."""
    # Shape inference (pipeline stages), the dry run; never inside torch.compile, whose
    # tracing tensors are fake too but whose kernels are the real ones below.
    if not torch.compiler.is_compiling() and (x.is_meta or _is_fake(x)):
        return _shape_only_linear(x, weight)
    if grouped_mm_supported(x, weight):
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)  # group ends, as the kernel wants
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return looped_linear(x, weight, tokens_per_expert)


def looped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The fallback: one matmul per expert over its contiguous slice (an expert with no
    tokens gets an empty matmul, so its weight still receives a zero gradient)."""
    pieces = x.split(tokens_per_expert.tolist())
    return torch.cat([piece @ w.t() for piece, w in zip(pieces, weight)])


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where torch._grouped_mm has a kernel: CUDA in bfloat16 (its meta registration's
    check), and torch's CPU build in float32 (1.0-1.6x the loop's speed, bench/moe_grouped_mm.py);
    both want every row 16 bytes aligned. Elsewhere (float64, CUDA float32) the loop."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-2]))
    if torch.compiler.is_compiling():  # the meta function compile traces with takes bf16 only, on any device
        return x.dtype == torch.bfloat16 and aligned
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and aligned
    return x.device.type == "cpu" and x.dtype == torch.float32 and aligned


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


def _shape_only_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """On meta or fake tensors the group sizes are unknown (they are data): every row goes
    through expert 0 -- the same shapes, FLOPs and saved activations as any routing."""
    return x @ weight[0].t() + 0 * weight.sum()  # every expert's weight in the graph: its gradient exists


class GroupedExperts(nn.Module):
    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate projection
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up projection
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down projection

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local(w) for w in (self.w1, self.w2, self.w3))
        h = F.silu(grouped_linear(x_sorted, w1, tokens_per_expert)) * grouped_linear(x_sorted, w3, tokens_per_expert)
        return grouped_linear(h, w2, tokens_per_expert)


def local(weight: torch.Tensor) -> torch.Tensor:
    """A weight replicated over tensor-parallel ranks is a DTensor (so that the optimizer,
    clipping and checkpoints treat it like every other weight); the dispatch computes on
    plain tensors, with this rank's copy. Its gradient comes back as the same DTensor's."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight
