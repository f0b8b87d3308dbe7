"""[training] chunked_loss: F.cross_entropy's loss and gradients (transformers' -100 labels
included) without the fp32 copy of the whole logits, its memory measured by torch's
tracker, the refusal next to [compile] loss, and the planner and dry run counting it.
Every layout trains with it like plain PyTorch: tests/test_parity.py (chunked_loss_*)."""

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshtrain.physics.gpus import GIB, get_gpu
from meshtrain.planning import kernels
from meshtrain.planning.activations import ProbeKey, activation_profile
from meshtrain.planning.estimate import estimate
from meshtrain.planning.plan import resolve_model
from meshtrain.planning.shape import Job
from meshtrain.parallel import ParallelDims
from meshtrain.training.chunked_loss import chunked_cross_entropy
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config
from meshtrain.training.step import loss_function


def logits_and_labels(tokens=37, vocab=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(3, tokens, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (3, tokens), generator=g)
    labels[0, :9] = -100  # a prompt; and one whole chunk of them below
    labels[2, 10:20] = -100
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_and_gradients_equal_f_cross_entropy_on_the_fp32_logits(dtype, reduction):
    logits, labels = logits_and_labels(dtype=dtype)
    x = logits.clone().requires_grad_()
    want = F.cross_entropy(x.flatten(0, 1).float(), labels.flatten(), reduction=reduction, ignore_index=-100)
    want_grad, = torch.autograd.grad(want, x)
    for tokens_a_chunk in (1, 7, 10, 1000):  # 111 tokens: uneven chunks (of ignored labels only, for 1 and 7), one chunk
        y = logits.clone().requires_grad_()
        got = chunked_cross_entropy(y, labels, reduction, chunk_elements=101 * tokens_a_chunk)
        grad, = torch.autograd.grad(got, y)
        assert grad.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * (want.abs().item() if reduction == "sum" else 1))
        torch.testing.assert_close(grad, want_grad, rtol=1e-5 if dtype == torch.float32 else 0.01, atol=1e-7)


def test_no_counted_label_gives_zero_sum_zero_gradient_and_f_s_nan_mean():
    logits, labels = logits_and_labels()
    labels[:] = -100
    x = logits.clone().requires_grad_()
    total = chunked_cross_entropy(x, labels, "sum", chunk_elements=101 * 5)
    assert total.item() == 0.0
    assert torch.count_nonzero(torch.autograd.grad(total, x)[0]) == 0
    mean = chunked_cross_entropy(logits, labels, "mean")
    assert math.isnan(mean.item()) and math.isnan(F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item())


def test_a_label_outside_the_vocabulary_is_refused_as_f_cross_entropy_refuses_it():
    logits, labels = logits_and_labels()
    for bad in (101, -1):
        labels[1, 3] = bad
        with pytest.raises(IndexError):
            F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        with pytest.raises(RuntimeError, match=r"a label is outside the vocabulary \[0, 101\) and not -100"):
            chunked_cross_entropy(logits, labels)


def peak_bytes_per_logit(loss_fn, tokens=2048, vocab=4096, **kwargs) -> float:
    """The peak of a forward and backward of the loss on bf16 logits made inside torch's
    memory tracker, above the logits themselves, per logit."""
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = MemTracker()
    with tracker:
        logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
        torch.autograd.grad(loss_fn(logits, labels, **kwargs), logits)
    peak = sum(kinds["Total"] for kinds in tracker.get_tracker_snapshot("peak").values())
    return (peak - logits.nbytes) / logits.numel()


def test_the_peak_is_the_gradient_and_one_fp32_chunk_where_f_cross_entropy_keeps_12_bytes_a_logit():
    plain = peak_bytes_per_logit(lambda x, y: F.cross_entropy(x.float(), y))
    # 2,048 tokens in chunks of 128: the bf16 gradient (2 bytes a logit) and one fp32 chunk (4 / 16)
    chunked = peak_bytes_per_logit(chunked_cross_entropy, chunk_elements=4096 * 128)
    print(f"bytes per logit above the logits: F.cross_entropy {plain:.2f}, chunked {chunked:.2f}")
    assert plain >= 12
    assert chunked == pytest.approx(2 + 4 / 16, abs=0.01)


class LogitTraffic(TorchDispatchMode):
    """Bytes each op moves over tensors of at least ``big`` elements (the logits, their fp32
    chunks and gradients; per-token vectors are left out), reading each input once and
    writing each output once: the count planning/kernels.py's LOSS_BYTES* make by hand.
    Views move nothing; indexing ops (gather, scatter_add_, nll) touch one element a token;
    copy_ does not read its destination; empty_like neither reads nor writes."""

    INDEXING = {"gather", "scatter_add_", "nll_loss_forward", "nll_loss_backward"}

    def __init__(self, big: int):
        super().__init__()
        self.big, self.bytes = big, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name, ret = func.overloadpacket.__name__, func._schema.returns
        if ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write:
            return out  # a view
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if name in self.INDEXING:  # a fresh output (nll's zero-filled gradient) is still written whole
            inputs, outputs = [], [o for o in outputs if not any(o is a for a in inputs)]
        elif name in ("copy_", "empty_like"):
            inputs = inputs[1:] if name == "copy_" else []
            outputs = outputs if name == "copy_" else []
        self.bytes += sum(t.nbytes for t in inputs + outputs if t.numel() >= self.big)
        return out


def logit_traffic(loss_fn, tokens=512, vocab=4096, **kwargs) -> float:
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    with LogitTraffic(big=tokens * vocab // 8) as traffic:
        torch.autograd.grad(loss_fn(logits, labels, **kwargs), logits)
    return traffic.bytes / logits.numel()


def test_the_planners_loss_traffic_is_what_the_two_losses_run():
    """The step time's loss term (planning/kernels.py) counts the bytes each loss's ops move
    per logit; counted here on the code itself, the default and the chunked one (4 chunks)."""
    plain = logit_traffic(lambda x, y: F.cross_entropy(x.float(), y))
    chunked = logit_traffic(chunked_cross_entropy, chunk_elements=4096 * 128)
    print(f"bytes moved per logit: F.cross_entropy {plain:.2f}, chunked {chunked:.2f}")
    assert plain == kernels.LOSS_BYTES
    assert chunked == kernels.LOSS_BYTES_CHUNKED
    shape, gpu = resolve_model("8B"), get_gpu("h100-80gb")
    loss = lambda **flags: kernels.loss_bytes_per_logit(Job(shape, gpu, 1, 1, 8192, 1, **flags))
    t = {c: kernels.head_seconds(shape, tokens=8192, tp=1, gpu=gpu, loss_bytes=loss(chunked_loss=c)).memory
         for c in (False, True)}
    assert t[True] / t[False] == pytest.approx(kernels.LOSS_BYTES_CHUNKED / kernels.LOSS_BYTES)


def compiled_logit_traffic(tokens=512, vocab=4096) -> float:
    """Bytes per logit the compiled loss's kernels read and write, as inductor's scheduler
    sizes each fused kernel's buffers (its own estimate of a kernel's memory traffic), summed
    over the forward's and the backward's kernels; inductor compiles them here for the CPU."""
    from torch._inductor import config, scheduler

    sizes, codegen = [], scheduler.Scheduler.codegen

    def counting(self):
        sizes.extend(node.get_read_write_buffers_sizes() for node in self.nodes)
        return codegen(self)

    torch._dynamo.reset()
    labels = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    with mock.patch.object(scheduler.Scheduler, "codegen", counting), config.patch(force_disable_caches=True):
        loss = loss_function(compiled=True)(logits, labels)
        grad, = torch.autograd.grad(loss, logits)
    torch._dynamo.reset()
    plain = F.cross_entropy(logits.detach().flatten(0, 1).float(), labels.flatten(0, 1))
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6) and grad.shape == logits.shape
    return sum(sizes) / logits.numel()


@pytest.mark.slow  # inductor compiles a forward and a backward: some 20 s on 2 cores
def test_the_planners_compiled_loss_traffic_is_what_inductor_generates():
    """[compile] loss: inductor fuses the fp32 upcast into the softmax's two passes and the
    backward into one kernel, 8 bytes a logit where the eager loss moves 36; the step time's
    loss term counts what its kernels move (the rest per token, under a byte a logit here)."""
    compiled = compiled_logit_traffic()
    print(f"bytes moved per logit: compiled cross-entropy {compiled:.3f}")
    assert round(compiled) == kernels.LOSS_BYTES_COMPILED
    shape, gpu = resolve_model("8B"), get_gpu("h100-80gb")
    loss = lambda **flags: kernels.loss_bytes_per_logit(Job(shape, gpu, 1, 1, 8192, 1, **flags))
    t = {c: kernels.head_seconds(shape, tokens=8192, tp=1, gpu=gpu, loss_bytes=loss(compiled_loss=c)).memory
         for c in (False, True)}
    assert t[True] / t[False] == pytest.approx(kernels.LOSS_BYTES_COMPILED / kernels.LOSS_BYTES)


def test_chunked_loss_with_compile_loss_is_refused_naming_both_keys(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text("[training]\nchunked_loss = true\n[compile]\nloss = true\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}: [training] chunked_loss = true with {path}: [compile] loss = true" in str(err.value)
    chunked = tmp_path / "chunked.toml"
    chunked.write_text("[training]\nchunked_loss = true\n")
    with pytest.raises(ConfigError, match=r"with command line: --compile.loss=true: both keep"):
        load_config(chunked, ["--compile.loss=true"])
    assert load_config(path, ["--compile.loss=false"]).training.chunked_loss


def test_the_probe_traces_the_chunked_loss_keeping_bf16_logits():
    """Llama 3 8B at 8,192 tokens: 1.05 G logits over 128,256 words. The traced head keeps
    its fp32 log-softmax (4 bytes a logit) with the default loss, the bf16 logits (2) with
    the chunked one; the loss's backward adds two fp32 tensors (8), or the bf16 gradient and
    one 256 MiB chunk."""
    logits = 8192 * 128256
    key = ProbeKey("llama", "8B", 128256, seq_len=8192, tp=1, ac="full")
    plain = activation_profile(key)
    chunked = activation_profile(ProbeKey(**{**key.__dict__, "chunked_loss": True}))
    assert plain.head - chunked.head == pytest.approx(2 * logits, rel=0.01)
    assert plain.head_working - chunked.head_working == pytest.approx(8 * logits - 2 * logits - 2**28, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_the_estimate_with_chunked_loss_is_within_10_percent_of_the_traced_step(tp):
    """The dry run traces train.py's step with the config's loss (planning/traced_step.py);
    the planner's estimate with its probe. Forgetting the loss on either side misses by 20%
    at tp 1 (the 8B plan's winner with chunked_loss: micro-batch 2 of 8,192 tokens)."""
    from meshtrain.planning.verify import trace

    job = Job(resolve_model("8B"), get_gpu("h100-80gb"), 1, 8, 8192, 16, chunked_loss=True)
    e = estimate(job, ParallelDims(tp=tp, pp=1, dp_replicate=1, dp_shard=8 // tp, world_size=8,
                                   strategy="FULL_SHARD", ac="op", micro_batch=2))
    plain = estimate(Job(**{**job.__dict__, "chunked_loss": False}), e.layout)
    assert plain.memory.total - e.memory.total > 4 * GIB / tp
    traced = trace(e, job)["memory"]["total"]
    assert traced == pytest.approx(e.memory.total, rel=0.10), \
        f"estimated {e.memory.total / GIB:.1f} GiB, traced {traced / GIB:.1f} GiB"
