"""The cross-entropy's memory and time: F.cross_entropy on the fp32 upcast (train.py's
default), the same compiled ([compile] loss) and `chunked_cross_entropy` ([training]
chunked_loss), side by side on the same bf16 logits.

    python -m bench.loss_memory                       # CPU: 4,096 tokens x 32,768 words
    python -m bench.loss_memory --device cuda --tokens 8192 --vocab 128256

Peak: the most bytes live during the loss's forward and backward, above the logits
themselves (CUDA: max_memory_allocated; CPU: torch's MemTracker), per logit. Time: the
median of --repeats forward + backward passes. Every variant's loss and gradient are
compared with the first's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from meshtrain.training.step import loss_function


def plain(logits, labels):
    # what training/step.py's default does, written out with torch alone
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def peak_bytes(fn, logits, labels) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Bytes above the logits at the loss's peak, the loss and the gradient."""
    x = logits.detach().requires_grad_()
    if logits.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(x, labels)
        grad, = torch.autograd.grad(loss, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, loss.detach(), grad
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:  # the logits made inside: the tracker counts a view's storage the first time it sees it
        x = logits.clone().requires_grad_()
        loss = fn(x, labels)
        grad, = torch.autograd.grad(loss, x)
    peak = tracker.get_tracker_snapshot("peak")
    return sum(kinds["Total"] for kinds in peak.values()) - x.nbytes, loss.detach(), grad


def seconds(fn, logits, labels, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        x = logits.detach().requires_grad_()
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.autograd.grad(fn(x, labels), x)
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: str = "cpu", tokens: int = 4096, vocab: int = 32768, repeats: int = 3,
            compiled: bool | None = None) -> dict:
    """One row per variant: bytes per logit at the peak, milliseconds, and the largest
    difference of its loss and gradient from plain's. ``compiled``: include [compile]
    loss (default: on CUDA only; on CPU compiling takes minutes)."""
    torch.manual_seed(0)
    # [batch, seq, vocab] and [batch, seq], as the model hands them to the loss
    logits = (torch.randn(1, tokens, vocab, device=device) * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    labels[:, : tokens // 8] = -100  # as a fine-tuning prompt's
    variants = {"plain": plain, "chunked": loss_function(chunked=True)}
    if compiled if compiled is not None else device == "cuda":
        variants["compiled"] = loss_function(compiled=True)
    rows, reference = {}, None
    for name, fn in variants.items():
        seconds(fn, logits, labels, 1)  # warm-up (and compilation)
        peak, loss, grad = peak_bytes(fn, logits, labels)
        if reference is None:
            reference = loss, grad
        rows[name] = {"bytes_per_logit": peak / logits.numel(), "ms": 1e3 * seconds(fn, logits, labels, repeats),
                      "loss_diff": abs(loss - reference[0]).item(),
                      "grad_max_diff": (grad.float() - reference[1].float()).abs().max().item()}
    machine = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'CPU'}, {torch.get_num_threads()} threads"
    return {"machine": machine, "torch": torch.__version__, "tokens": tokens, "vocab": vocab, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="also [compile] loss (on CUDA: always)")
    args = p.parse_args(argv)
    result = measure(args.device, args.tokens, args.vocab, args.repeats, args.compiled or None)
    print(f"{result['machine']}, torch {result['torch']}: {args.tokens:,} tokens x {args.vocab:,} words, bf16 logits")
    print(f"{'loss':10s} {'bytes/logit at peak':>20s} {'ms fwd+bwd':>11s} {'|loss - plain|':>15s} {'max |grad - plain|':>19s}")
    for name, r in result["rows"].items():
        print(f"{name:10s} {r['bytes_per_logit']:20.2f} {r['ms']:11.1f} {r['loss_diff']:15.2e} {r['grad_max_diff']:19.2e}")
    return result


if __name__ == "__main__":
    main()
