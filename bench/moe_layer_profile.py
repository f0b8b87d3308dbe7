"""Where one MoE layer's time goes: models/moe's whole layer, forward + backward, under
torch.profiler (its top kernels), and the dispatch / combine pieces alone, each way of
writing them side by side.

    python -m bench.moe_layer_profile --device cuda      # Qwen3-30B-A3B's layer, bf16
    python -m bench.moe_layer_profile                    # CPU: the debug shape, fp32

Combine (the k weighted expert outputs of each token added back onto it):
- index_add: `zeros.index_add_(0, source, routed)`, T * k rows added onto T (atomics on CUDA);
- unsort_sum: the copies put back in token order (a permutation, no two rows collide),
  then viewed [T, k, dim] and summed over k.
Dispatch (each token copied once per chosen expert, grouped by expert):
- gather: `tokens[order // k]` (its backward adds k rows onto each token);
- expand: `tokens.expand(k)` flattened, then the permutation `[order]` (backward: a
  permutation back, then a sum over k).
"""

from __future__ import annotations

import argparse

import torch

from bench.muon_step import timed
from meshtrain.models.moe import MoETransformer


def timed_ms(fn, device: torch.device, repeat: int) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call (bench/muon_step.py's timer)."""
    return 1e3 * timed(fn, device, repeat)


def dispatch_gather(tokens, order, k):
    return tokens[order // k]


def dispatch_expand(tokens, order, k):
    return tokens.unsqueeze(1).expand(-1, k, -1).reshape(-1, tokens.shape[-1])[order]


def combine_index_add(routed, order, k, n_tokens):
    return torch.zeros(n_tokens, routed.shape[-1], dtype=routed.dtype, device=routed.device).index_add_(
        0, order // k, routed)


def combine_unsort_sum(routed, order, k, n_tokens):
    unsorted = torch.empty_like(routed).index_copy(0, order, routed)
    return unsorted.view(n_tokens, k, -1).sum(dim=1)


def pieces(device, dtype, n_tokens, dim, n_experts, k, repeat) -> dict:
    """Each dispatch and combine, forward + backward, on random routing."""
    tokens = torch.randn(n_tokens, dim, device=device, dtype=dtype, requires_grad=True)
    chosen = torch.rand(n_tokens, n_experts, device=device).topk(k, dim=-1).indices
    order = chosen.reshape(-1).argsort(stable=True)
    routed = torch.randn(n_tokens * k, dim, device=device, dtype=dtype, requires_grad=True)
    out = {}
    for name, fn in (("dispatch gather", dispatch_gather), ("dispatch expand", dispatch_expand)):
        out[name] = timed_ms(lambda: fn(tokens, order, k).sum().backward(), device, repeat)
    for name, fn in (("combine index_add", combine_index_add), ("combine unsort_sum", combine_unsort_sum)):
        out[name] = timed_ms(lambda: fn(routed, order, k, n_tokens).sum().backward(), device, repeat)
    # The variants must agree, or the timing compares different work.
    assert torch.allclose(dispatch_gather(tokens, order, k), dispatch_expand(tokens, order, k))
    a, b = combine_index_add(routed, order, k, n_tokens), combine_unsort_sum(routed, order, k, n_tokens)
    assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item())
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tokens", type=int, default=0, help="tokens per step (default: 8192 on CUDA, 512 on CPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    flavor = "qwen3_30b_a3b" if cuda else "debug"
    n_tokens = args.tokens or (8192 if cuda else 512)
    model = MoETransformer.from_flavor(flavor, meta=True, n_layers=1, n_dense_layers=0)
    layer = model.layers["0"].feed_forward.to_empty(device=device)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    layer.to(dtype)
    x = torch.randn(1, n_tokens, model.cfg.dim, device=device, dtype=dtype, requires_grad=True)
    step = lambda: layer(x).sum().backward()
    result = {"flavor": flavor, "tokens": n_tokens, "dtype": str(dtype), "device": str(device),
              "layer_ms": timed_ms(step, device, args.repeat),
              "pieces_ms": pieces(device, dtype, n_tokens, model.cfg.dim, model.cfg.n_experts, model.cfg.top_k,
                                  args.repeat)}
    activity = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activity) as prof:
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60)
    print(f"one {flavor} MoE layer, {n_tokens} tokens, {dtype}, {device}: forward + backward "
          f"{result['layer_ms']:.2f} ms (median of {args.repeat})")
    for name, ms in result["pieces_ms"].items():
        print(f"  {name:<20} {ms:8.2f} ms forward + backward")
    print(table)
    result["profile"] = table
    return result


if __name__ == "__main__":
    main()
