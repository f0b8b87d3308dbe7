"""One rank's optimizer step, Muon vs AdamW, at Llama 3 8B's hidden matrices (32 layers of
wq, wo 4096 x 4096; wk, wv 1024 x 4096; w1, w3 14336 x 4096; w2 4096 x 14336), for a shard
group of W ranks (training/muon.py):

- Muon: each rank orthogonalises ceil(k / W) whole matrices of each shape group (k
  matrices of that shape: wk and wv together), with torch's own Newton-Schulz, and runs
  the momentum and the update on its 1/W shard of every matrix;
- AdamW: torch.optim.AdamW(fused=True) on the same 1/W shard.

    python -m bench.muon_step                    # CPU: one Newton-Schulz per shape, times the count
    python -m bench.muon_step --device cuda      # every owned matrix, timed whole

The all-to-alls are not run here (one process): their bytes per rank are printed. On CPU
a whole 8B share is minutes of bf16 matmuls, so each shape's Newton-Schulz is timed once
and multiplied by the number of matrices the rank owns, and the elementwise work (and
AdamW) is timed on one layer's shard and multiplied by the layers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

DIM, KV, HIDDEN = 4096, 1024, 14336
LAYER = {"wq": (DIM, DIM), "wk": (KV, DIM), "wv": (KV, DIM), "wo": (DIM, DIM),
         "w1": (HIDDEN, DIM), "w2": (DIM, HIDDEN), "w3": (HIDDEN, DIM)}


def timed(fn, device, repeat: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shape_groups(layers: int) -> dict[tuple[int, int], int]:
    groups: dict[tuple[int, int], int] = {}
    for shape in LAYER.values():
        groups[shape] = groups.get(shape, 0) + layers
    return groups


def elementwise_shards(ranks: int, layers: int, device) -> tuple[list, list]:
    """(params, grads) of ``layers`` layers' 1/ranks shards (rows), fp32."""
    shards = [(math.ceil(r / ranks), c) for r, c in LAYER.values()] * layers
    params = [torch.randn(s, device=device) for s in shards]
    return params, [torch.randn(s, device=device) for s in shards]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="W, the ranks of the shard group")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    whole = device.type == "cuda"  # CPU: one matrix per shape, one layer's elementwise work, scaled

    ns_seconds, rows = 0.0, []
    for shape, k in shape_groups(args.layers).items():
        owned = math.ceil(k / args.ranks)
        count = owned if whole else 1
        mats = [torch.randn(shape, device=device) for _ in range(count)]
        t = timed(lambda: [_zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7) for m in mats],
                  device, args.repeat if whole else 1)
        t = t if whole else t * owned
        ns_seconds += t
        rows.append(f"  Newton-Schulz {shape[0]:>5} x {shape[1]:<5}  {owned:3d} of {k:3d} matrices on this rank  {t:8.3f} s")

    measured_layers = args.layers if whole else 1
    params, grads = elementwise_shards(args.ranks, measured_layers, device)
    bufs = [torch.zeros_like(g) for g in grads]

    def muon_elementwise():
        for param, grad, buf in zip(params, grads, bufs):
            buf.lerp_(grad, 0.05)
            update = grad.lerp(buf, 0.95).bfloat16()  # what crosses the all-to-all
            param.mul_(1 - 1e-4)
            param.add_(update, alpha=-1e-3)

    for param, grad in zip(params, grads):
        param.grad = grad
    adamw = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scale = args.layers / measured_layers
    elementwise = timed(muon_elementwise, device, args.repeat) * scale
    adamw_seconds = timed(adamw.step, device, args.repeat) * scale

    hidden = sum(r * c for r, c in LAYER.values()) * args.layers
    wire = 2 * 2 * hidden / args.ranks * (args.ranks - 1) / args.ranks  # two all-to-alls of bf16
    print(f"meshtrain Muon vs AdamW optimizer step, Llama 3 8B hidden matrices ({hidden / 1e9:.2f} B), "
          f"one rank of W = {args.ranks}, {device.type}{'' if whole else ' (scaled, see --help)'}")
    print("\n".join(rows))
    print(f"  Muon momentum + update on the shard               {elementwise:8.3f} s")
    print(f"  Muon step (without the all-to-alls)               {ns_seconds + elementwise:8.3f} s")
    print(f"  AdamW (fused) step on the same shard              {adamw_seconds:8.3f} s")
    print(f"  Muon / AdamW                                      {(ns_seconds + elementwise) / adamw_seconds:8.1f} x")
    print(f"  all-to-all bytes received per rank (both ways)    {wire / 1e9:8.2f} GB")


if __name__ == "__main__":
    main()
