"""Tokens/s of a packed, document-masked training step next to today's causal step.

    python -m bench.document_masking                      # CPU: debug Llama, seq 2048 and 8192
    python -m bench.document_masking --device cuda        # Llama-3-8B-shaped blocks, bf16

Both steps run training/step.py's train_step on the same model, weights and batch of
packed documents (lengths drawn like short fine-tuning records, 64 to 1024 tokens); the
causal step calls the model without positions (attention runs across the documents, one
causal SDPA), the masked step with them (models/documents.py: on CUDA a FlexAttention
block mask, elsewhere a boolean block-causal mask for SDPA; rotary angles by each token's
position). On CUDA a third step times the boolean SDPA mask there too, and one attention
call checks that the two kernels agree (outputs and gradients, against SDPA's). Reported:
the median step time of ``--steps`` steps after one warm-up (compilation in it), as
tokens/s, and masked / causal. bench/gpu_check.py runs this on a GPU (the target there:
masked >= 0.95x causal).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain.models import documents
from meshtrain.models.llama.model import Llama
from meshtrain.parallel.context_parallel import causal_attention
from meshtrain.training.step import train_step

SHAPES = {  # device -> (flavor, layers, parameter dtype)
    "cpu": ("debug", 2, torch.float32),
    "cuda": ("8B", 8, torch.bfloat16),  # 8 blocks share one mask per step, as a whole model's do
}


def packed_batch(batch: int, seq_len: int, vocab: int, seed: int = 0):
    """(inputs, labels, positions) [batch, seq_len]: documents of 64..1024 tokens back to
    back, positions restarting at each (the last one cut at the sequence end)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.empty(batch, seq_len, dtype=torch.int64)
    for row in positions:
        at = 0
        while at < seq_len:
            n = min(int(torch.randint(64, 1025, (), generator=g)), seq_len - at)
            row[at:at + n] = torch.arange(n)
            at += n
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], positions


def measure(device: torch.device, seq_lens=(2048, 8192), steps: int = 3, batch: int = 1,
            layers: int = 0) -> list[dict]:
    """One row per sequence length: tokens/s of the causal and the masked step, and their ratio."""
    flavor, default_layers, dtype = SHAPES[device.type]
    layers = layers or default_layers
    rows = []
    for seq_len in seq_lens:
        model = Llama.from_flavor(flavor, meta=True, n_layers=layers, max_seq_len=seq_len,
                                  vocab_size=32_768 if device.type == "cuda" else 256)
        model.init_weights(seed=0, device=device)
        for p in model.parameters():  # the weights in the compute dtype; the rotary tables stay fp32
            p.data = p.data.to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: both see the same model
        inputs, labels, positions = (t.to(device) for t in packed_batch(batch, seq_len, model.cfg.vocab_size))
        row = {"seq_len": seq_len, "batch": batch, "flavor": flavor, "layers": layers, "dtype": str(dtype),
               "documents_per_sequence": float((positions == 0).sum()) / batch}
        variants = [("causal", [(inputs, labels)], True), ("masked", [(inputs, labels, positions)], True)]
        if device.type == "cuda":  # the boolean SDPA mask, as on CPU
            variants.append(("masked_sdpa", [(inputs, labels, positions)], False))
        for name, micro, flex in variants:
            documents.flex_on_cuda = flex
            times = []
            for i in range(steps + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                train_step(model, optimizer, micro, device=device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i:  # the first is the warm-up
                    times.append(time.perf_counter() - start)
            row[f"{name}_tokens_per_second"] = batch * seq_len / statistics.median(times)
        documents.flex_on_cuda = True
        row["masked_over_causal"] = row["masked_tokens_per_second"] / row["causal_tokens_per_second"]
        if device.type == "cuda":
            row["masked_sdpa_over_causal"] = row["masked_sdpa_tokens_per_second"] / row["causal_tokens_per_second"]
            row["flex_vs_sdpa"] = kernels_agree(model.cfg, positions)
            row["block_mask_ms"] = block_mask_ms(positions)
        rows.append(row)
        del model, optimizer
    return rows


def block_mask_ms(positions: torch.Tensor, repeats: int = 10) -> float:
    """Median milliseconds to build the step's BlockMask (once per step, shared by every layer)."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        documents.document_block_mask(positions)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def kernels_agree(cfg, positions: torch.Tensor) -> dict:
    """One attention call of the model's head shape, in fp32: the block-masked FlexAttention
    (what the model runs on CUDA) against SDPA with the boolean mask. Largest differences of
    the output and of q's gradient, each over the reference's largest magnitude."""
    g = torch.Generator(device=positions.device).manual_seed(0)
    b, s = positions.shape
    q = torch.randn(b, s, cfg.n_heads, cfg.head_dim, device=positions.device, generator=g)
    k, v = (torch.randn(b, s, cfg.n_kv_heads, cfg.head_dim, device=positions.device, generator=g) for _ in range(2))
    results = []
    for mask in (documents.document_block_mask(positions), documents.document_bool_mask(positions)):
        qq = q.clone().requires_grad_()
        out = causal_attention(qq, k, v, None, mask=mask, enable_gqa=True)
        out.square().sum().backward()
        results.append((out.detach(), qq.grad))
    (flex, flex_grad), (ref, ref_grad) = results
    return {"output_rel": ((flex - ref).abs().max() / ref.abs().max()).item(),
            "grad_rel": ((flex_grad - ref_grad).abs().max() / ref_grad.abs().max()).item()}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seq-lens", default="2048,8192", help="comma-separated sequence lengths")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row, after one warm-up")
    p.add_argument("--layers", type=int, default=0, help="blocks (default: 2)")
    args = p.parse_args(argv)
    rows = measure(torch.device(args.device), [int(s) for s in args.seq_lens.split(",")], args.steps,
                   layers=args.layers)
    print("| seq | documents / sequence | causal tokens/s | masked tokens/s | masked / causal |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print({k: v for k, v in r.items() if "per_second" in k or k in ("layers", "block_mask_ms", "flex_vs_sdpa")})
        print(f"| {r['seq_len']} | {r['documents_per_sequence']:.1f} | {r['causal_tokens_per_second']:,.0f} | "
              f"{r['masked_tokens_per_second']:,.0f} | {r['masked_over_causal']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
