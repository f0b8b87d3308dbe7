"""The experts of one MoE layer, forward + backward, three ways (models/moe/experts.py):

- loop:    one matmul per expert over its contiguous slice of the sorted tokens (the
           fallback `looped_linear`);
- grouped: `torch._grouped_mm` with the group ends as offsets (on CUDA in bfloat16: the
           path the model takes; torch 2.13's CPU build also runs it, in float32);
- padded:  every expert's tokens padded to the largest group, one batched matmul.

    python -m bench.moe_grouped_mm                        # CPU, float32
    python -m bench.moe_grouped_mm --device cuda --dtype bfloat16

Routing is drawn from a skewed distribution (expert e gets weight 1 / (e + 1)), the
imbalance real routers show early in training, so the padded path pays for its padding.
Median milliseconds after warm-up, one row per shape.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.kernel_speeds import timed
from meshtrain.models.moe.experts import looped_linear

# (tokens, dim, expert hidden, experts, top_k): the debug flavor's layer, then wider ones with
# more experts. (A Qwen3-30B-A3B layer, 128 experts of 768 at dim 2048, runs for minutes per
# path on one CPU core: measure it on a GPU.)
SHAPES = [(4096, 64, 64, 8, 2), (4096, 512, 256, 16, 2), (2048, 1024, 512, 64, 6)]


def grouped_linear_mm(x, w, counts):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.cumsum(counts, 0, dtype=torch.int32))


def padded_linear(x, w, counts):
    """Pad each group to the largest, one bmm, drop the padding."""
    longest = int(counts.max())
    rows = torch.arange(longest, device=x.device)
    starts = torch.cumsum(counts, 0) - counts
    mask = rows[None, :] < counts[:, None]                     # [E, longest]
    index = (starts[:, None] + rows[None, :]).clamp(max=len(x) - 1)
    padded = x[index] * mask[..., None]                         # [E, longest, in]
    return torch.bmm(padded, w.transpose(-2, -1))[mask]         # back to [T, out], expert order


def experts(linear, x, w1, w2, w3, counts):
    return linear(F.silu(linear(x, w1, counts)) * linear(x, w3, counts), w2, counts)


# A Qwen3-30B-A3B layer (128 experts of 768, top 8, dim 2048) on 8192 tokens: GPU only.
GPU_SHAPES = SHAPES + [(8192, 2048, 768, 128, 8)]
PATHS = {"loop": looped_linear, "grouped": grouped_linear_mm, "padded": padded_linear}


def measure(device: torch.device, dtype: torch.dtype, shapes, repeats: int = 5) -> list[dict]:
    """One row per shape: each path's median forward + backward in ms (None where the device
    or dtype has no kernel for it, the error beside it)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens, dim, hidden, n_experts, k in shapes:
        weights = 1.0 / torch.arange(1, n_experts + 1)
        chosen = torch.multinomial(weights.expand(tokens, -1), k, generator=g)
        counts = torch.bincount(chosen.flatten(), minlength=n_experts).to(device)
        x = torch.randn(tokens * k, dim, generator=g).to(device, dtype).requires_grad_()
        w1, w3 = (torch.randn(n_experts, hidden, dim, generator=g).mul(0.02).to(device, dtype).requires_grad_()
                  for _ in range(2))
        w2 = torch.randn(n_experts, dim, hidden, generator=g).mul(0.02).to(device, dtype).requires_grad_()
        upstream = torch.randn(tokens * k, dim, generator=g).to(device, dtype)
        row = {"tokens": tokens, "top_k": k, "dim": dim, "hidden": hidden, "experts": n_experts,
               "max_over_mean": counts.max().item() / counts.float().mean().item(), "errors": {}}
        for name, linear in PATHS.items():
            def step():
                (experts(linear, x, w1, w2, w3, counts) * upstream).sum().backward()
            try:
                row[f"{name}_ms"] = timed(step, device, repeats) * 1e3
            except RuntimeError as err:  # a path this device or dtype has no kernel for
                row[f"{name}_ms"] = None
                row["errors"][name] = str(err).splitlines()[0]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes = GPU_SHAPES if device.type == "cuda" else SHAPES
    print(f"{'tokens x k':>11s} {'dim':>5s} {'hidden':>6s} {'E':>4s} {'max/mean':>8s}  "
          + "  ".join(f"{name + ' ms':>10s}" for name in PATHS))
    for r in measure(device, dtype, shapes, args.repeats):
        for name, err in r["errors"].items():
            print(f"  {name}: {err}")
        cells = "  ".join(f"{r[name + '_ms']:10.1f}" if r[name + "_ms"] is not None else f"{'n/a':>10s}"
                          for name in PATHS)
        print(f"{r['tokens']:>6d} x {r['top_k']:<2d} {r['dim']:5d} {r['hidden']:6d} {r['experts']:4d} "
              f"{r['max_over_mean']:8.2f}  " + cells)


if __name__ == "__main__":
    main()
