"""Measure the three speeds the planner's step time is built from (planning/kernels.py).

    python -m bench.kernel_speeds [--out bench/results/kernels_h100.json]     # on a GPU
    python -m bench.kernel_speeds --device cpu --quick                          # smoke run

- matmul: bf16 TFLOP/s of the 8192^3 matmul physics/gpus.py's `matmul_efficiency` is from,
  and of the shapes blocks 2,048 to 8,192 wide run under TP 1-8 over 4K and 16K tokens:
  each Linear's forward (tokens x in x out / tp), input gradient (tokens x out / tp x in)
  and weight gradient (in x tokens x out / tp). Written with --out into bench/results, the
  planner times matmuls from this table for that GPU instead of its roofline
  (planning/matmul.py);
- attention: SDPA (flash backend on a GPU) forward + backward, causal, head dim 128, batch
  x sequence = 16K tokens as in the FlashAttention papers, TFLOP/s counted their way
  (4·s²·d per head forward, halved by the mask; backward 2.5x): `attention_efficiency`;
- memory: GB/s of a device-to-device copy (`hbm_bandwidth`) and of an eager and a
  compiled RMSNorm forward + backward, in the bytes planning/kernels.py counts for it;
  and the Llama model's eager rotary (`apply_rope`, one complex multiply) on an 8B
  block's q and k at 8,192 tokens, forward + backward, as the bytes per element at the
  measured copy speed that its time is worth: the number planning/kernels.py counts 14
  of (the hand-rotated pairs the earlier measured runs ran).

Prints one row per measurement and the fractions of the GPU's peak (physics/gpus.py)
to put in its table, and writes them as JSON. Each is the median of timed repeats after
warm-up, synchronised with the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmuls(device, dtype, quick: bool, repeats: int) -> list[dict]:
    linears = ((2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336), (8192, 8192), (8192, 28672))
    forward = {(tokens, h, out // tp) for h, out in linears for tp in (1, 2, 4, 8) for tokens in (4096, 16384)}
    three = {s for m, k, n in forward for s in ((m, k, n), (m, n, k), (k, m, n))}
    shapes = [(256, 256, 256)] if quick else [(8192, 8192, 8192)] + sorted(three - {(8192, 8192, 8192)})
    rows = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(lambda: a @ b, device, repeats)
        rows.append({"m": m, "k": k, "n": n, "tflops": 2 * m * k * n / seconds / 1e12})
    return rows


def attention(device, dtype, quick: bool, repeats: int) -> list[dict]:
    rows, d, heads = [], 128, 2 if quick else 16
    for seq in ([128] if quick else [1024, 2048, 4096, 8192, 16384]):
        batch = max(1, (256 if quick else 16384) // seq)
        q, k, v = (torch.randn(batch, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        seconds = timed(step, device, repeats)
        flops = 4 * seq * seq * d * heads * batch / 2 * 3.5
        rows.append({"seq": seq, "batch": batch, "tflops": flops / seconds / 1e12})
    return rows


def memory(device, dtype, quick: bool, repeats: int) -> dict:
    n = 1 << (20 if quick else 28)
    x, y = torch.empty(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
    copy = 2 * n * x.element_size() / timed(lambda: y.copy_(x), device, repeats)
    h = 4096
    t = torch.randn(n // h, h, device=device, dtype=dtype, requires_grad=True)
    norm = torch.nn.RMSNorm(h, device=device, dtype=dtype)

    def eager():
        norm(t).backward(torch.ones_like(t))

    out = {"copy_gbs": copy / 1e9, "rmsnorm_eager_s": timed(eager, device, repeats)}
    if device.type == "cuda":
        compiled = torch.compile(norm)
        out["rmsnorm_compiled_s"] = timed(lambda: compiled(t).backward(torch.ones_like(t)), device, repeats)
    # planning/kernels.py counts an eager RMSNorm at 40 bytes per element forward and twice
    # that backward: the bandwidth that count implies.
    out["rmsnorm_eager_gbs_as_counted"] = 3 * 40 * t.numel() / out["rmsnorm_eager_s"] / 1e9
    out.update(rotary(device, dtype, quick, repeats, copy))
    return out


def rotary(device, dtype, quick: bool, repeats: int, copy_bytes_per_s: float) -> dict:
    """The eager rotary of one Llama-3-8B block (q: 32 heads, k: 8, head dim 128, 8,192
    tokens), forward and backward, and what its time is worth in bytes per element of q
    and k at the copy speed just measured. planning/kernels.py counts a forward's 14 and
    a backward twice that (3 x 14 in all); a measured value far from it says to recount."""
    from meshtrain.models.llama.model import apply_rope, rotary_angles

    seq, head_dim = (128, 16) if quick else (8192, 128)
    theta = torch.rand(seq, head_dim // 2, device=device) * 6.28
    angles = rotary_angles(torch.stack((theta.cos(), theta.sin()), dim=-1))  # as the model's table: unit complex
    q = torch.randn(1, seq, 32, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, seq, 8, head_dim, device=device, dtype=dtype, requires_grad=True)
    grad_q, grad_k = torch.ones_like(q), torch.ones_like(k)

    def step():
        torch.autograd.backward((apply_rope(q, angles), apply_rope(k, angles)), (grad_q, grad_k))

    seconds = timed(step, device, repeats)
    return {"rotary_eager_s": seconds,
            "rotary_eager_bytes_per_element": seconds * copy_bytes_per_s / (3 * (q.numel() + k.numel()))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, numbers meaningless")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "quick": args.quick,
              "matmul": matmuls(device, dtype, args.quick, args.repeats),
              "attention": attention(device, dtype, args.quick, args.repeats),
              "memory": memory(device, dtype, args.quick, args.repeats)}
    from meshtrain.physics.gpus import gpu_of_device

    gpu = gpu_of_device(name)
    for row in result["matmul"]:
        print(f"matmul {row['m']} x {row['k']} x {row['n']}: {row['tflops']:.1f} TFLOP/s")
    for row in result["attention"]:
        print(f"attention seq {row['seq']} (batch {row['batch']}): {row['tflops']:.1f} TFLOP/s")
    print(f"copy: {result['memory']['copy_gbs']:.0f} GB/s")
    print(f"rotary (eager, forward + backward): {result['memory']['rotary_eager_s'] * 1e3:.2f} ms, "
          f"{result['memory']['rotary_eager_bytes_per_element']:.1f} bytes per element forward at the copy speed "
          f"(planning/kernels.py counts 14)")
    if gpu is not None:
        peak = gpu.peak_bf16_flops / 1e12
        result["fractions"] = {"matmul_efficiency": result["matmul"][0]["tflops"] / peak,
                               "attention_efficiency": statistics.median(r["tflops"] for r in result["attention"]) / peak,
                               "hbm_bandwidth": result["memory"]["copy_gbs"] * 1e9}
        print(f"for physics/gpus.py ({gpu.name}): {result['fractions']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
