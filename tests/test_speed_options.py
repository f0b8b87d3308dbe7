"""Speed options change speed and memory, not numbers: activation checkpointing (full,
selective, op), torch.compile of the blocks and the loss; async TP and float8 refused
clearly where they cannot run; the benchmark's CPU mode. One process, no torchrun."""

import collections
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.models.llama import Llama
from meshtrain.parallel import ParallelDims, apply_ac, apply_fsdp, mixed_precision_policy, parallelize
from meshtrain.parallel.float8 import apply_float8
from tests.conftest import ROOT
from meshtrain.training import recipe
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config
from meshtrain.training.metrics import TrackedActivations
from meshtrain.training.step import cross_entropy, select_loss, train_step


def tokens(batch=2, seq=64, vocab=256, seed=0):
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def grads_by_name(model):
    # checkpoint_wrapper and torch.compile add a level to the names; the parameters are the same.
    return {name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad
            for name, p in model.named_parameters()}


def train_losses(model, steps=3):
    """Losses of ``steps`` AdamW steps (clipping engaged) and the last gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x = tokens(seq=32, seed=step)
        losses.append(train_step(model, optimizer, [(x[:, :-1], x[:, 1:])], max_norm=1.0)[0])
    return torch.tensor(losses), grads_by_name(model)


@pytest.fixture
def one_rank_mesh():
    """A real gloo process group of one, so FSDP2 runs in this process."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    store = dist.FileStore(path, 1)  # the store deletes its file when the group is gone
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    dist.destroy_process_group()


# ---------------------------------------------------------------- activation checkpointing

class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


MM, SDPA = torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def forward_backward(mode):
    """Loss, gradients and the ops run in backward, for the 4-layer debug Llama under ``mode``."""
    model = Llama.from_flavor("debug")
    apply_ac(model.layers, mode, every=2)
    x = tokens()
    loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
    with CountOps() as backward_ops:
        loss.backward()
    return loss, grads_by_name(model), backward_ops.counts


def test_every_checkpointing_mode_gives_bitwise_the_same_loss_and_gradients():
    loss, grads, ops = forward_backward("none")
    assert ops[SDPA] == 0 and ops[MM] > 0
    for mode in ("full", "selective", "op"):
        other_loss, other_grads, other_ops = forward_backward(mode)
        assert torch.equal(other_loss, loss), mode
        assert other_grads.keys() == grads.keys()
        for name in grads:
            assert torch.equal(other_grads[name], grads[name]), (mode, name)
        # What each mode recomputes in backward: full redoes every block's forward (its
        # attention, and 6 of its 7 matmuls: torch stops recomputing once it has every
        # tensor backward needs, which w2's output is not), selective every other block's,
        # op neither matmuls nor attention.
        blocks = {"full": 4, "selective": 2, "op": 0}[mode]
        assert other_ops[MM] == ops[MM] + 6 * blocks, mode
        assert other_ops[SDPA] == blocks, mode


@pytest.mark.slow
def test_checkpointing_lowers_the_activation_memory_kept_for_backward():
    x = tokens(batch=4, seq=128)
    kept = {}
    for mode in ("none", "selective", "op", "full"):
        model = Llama.from_flavor("debug")
        apply_ac(model.layers, mode, every=2)
        with TrackedActivations() as tracked:
            logits = model(x[:, :-1])
        kept[mode] = tracked.bytes()
        del logits
        assert tracked.bytes() == 0  # freed with the graph: only activations were counted
    print("activation bytes kept for backward (debug Llama, 4 layers, batch 4 x 128):",
          ", ".join(f"{mode} {n / 2**20:.2f} MiB" for mode, n in kept.items()))
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["full"] < kept["op"] < kept["none"]
    # Full keeps one input per block, plus the head's activations.
    assert kept["full"] < 0.2 * kept["none"]


# ---------------------------------------------------------------- mixed precision

def test_bf16_mixed_precision_computes_in_bf16_on_fp32_master_weights_with_an_fp32_loss(one_rank_mesh):
    fp32, _ = train_losses(Llama.from_flavor("debug", n_layers=2, max_seq_len=32))
    model = Llama.from_flavor("debug", n_layers=2, max_seq_len=32, meta=True)
    # The mesh one process gets from ParallelDims: parallelize still applies FSDP, for its
    # mixed precision, although there is no data parallelism.
    parallelize(model, one_rank_mesh, mixed_precision=mixed_precision_policy("bfloat16", "float32"))
    model.init_weights(seed=0)
    x = tokens(seq=32)
    logits = model(x[:, :-1])
    assert logits.dtype == torch.bfloat16 and cross_entropy(logits, x[:, 1:]).dtype == torch.float32
    del logits
    bf16, grads = train_losses(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the sharded master weights
    assert all(g.dtype == torch.float32 for g in grads.values())      # and their fp32 gradients
    print("fp32 losses", fp32.tolist(), "bf16", bf16.tolist())
    torch.testing.assert_close(bf16, fp32, rtol=1e-2, atol=0)
    assert not torch.equal(bf16, fp32)  # bf16 compute really ran


# ---------------------------------------------------------------- torch.compile

@pytest.mark.slow
def test_compiled_blocks_with_op_checkpointing_and_compiled_loss_match_eager(one_rank_mesh):
    """The production order -- AC, then compile, then FSDP -- through `parallelize`, with
    the loss compiled too; fp32, so only fusion rounding may differ from eager."""
    eager, eager_grads = train_losses(Llama.from_flavor("debug", n_layers=2, max_seq_len=32))

    model = Llama.from_flavor("debug", n_layers=2, max_seq_len=32, meta=True)
    model = parallelize(model, one_rank_mesh, activation_checkpoint="op", compile=True)
    # parallelize leaves a one-rank dp dimension out; add FSDP by hand, as the bench does.
    apply_fsdp(model, one_rank_mesh, model.fsdp_units())
    model.init_weights(seed=0)
    select_loss(compiled=True)
    try:
        compiled, compiled_grads = train_losses(model)
    finally:
        select_loss()
    print("eager losses", eager.tolist(), "compiled", compiled.tolist())
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name].full_tensor(), grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- refusals

def cfg_with(*overrides):
    return load_config(None, ["--job.device=cpu", *overrides])


def test_op_mode_and_the_new_keys_are_accepted_and_typos_get_a_suggestion():
    cfg = cfg_with("--activation_checkpoint.mode=op", "--compile.loss=true", "--float8.enable=false")
    assert cfg.activation_checkpoint.mode == "op" and cfg.compile.loss and not cfg.float8.enable
    with pytest.raises(ConfigError, match='Did you mean "op"'):
        cfg_with("--activation_checkpoint.mode=ops")


def test_async_tp_is_refused_before_the_process_group_naming_each_missing_piece():
    cfg = cfg_with("--compile.async_tp=true", "--parallelism.tp=1")
    with pytest.raises(ConfigError) as err:
        recipe.check_speed_options(cfg, dims_of(cfg, 1))
    msg = str(err.value)
    assert msg.startswith("[compile] async_tp = true cannot run here")
    assert "needs CUDA" in msg and "[compile] enable must be true" in msg and "tp must be > 1" in msg
    assert not dist.is_initialized()


def test_async_tp_is_refused_by_parallelize_on_cpu(fake_world):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="async_tp: it needs CUDA"):
        parallelize(Llama.from_flavor("debug", meta=True), mesh, compile=True, async_tp=True)


def test_float8_without_torchao_names_the_pip_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    cfg = cfg_with("--float8.enable=true")
    with pytest.raises(ConfigError) as err:
        recipe.check_speed_options(cfg, dims_of(cfg, 1))
    msg = str(err.value)
    assert msg.startswith("[float8] enable = true cannot run here") and "pip install torchao" in msg
    with pytest.raises(ValueError, match=r"pip install torchao"):
        apply_float8(Llama.from_flavor("debug", meta=True))


def test_float8_with_tp_on_cpu_passes_the_check_and_rowwise_all_gather_is_refused():
    cfg = cfg_with("--float8.enable=true", "--parallelism.tp=2", "--parallelism.dp_shard=1")
    recipe.check_speed_options(cfg, dims_of(cfg, 2))  # torch's CPU float8 matmul runs it
    cfg = cfg_with("--float8.enable=true", "--float8.recipe=rowwise", "--float8.enable_fsdp_float8_all_gather=true")
    with pytest.raises(ConfigError, match=r'enable_fsdp_float8_all_gather = true needs recipe = "tensorwise"'):
        recipe.check_speed_options(cfg, dims_of(cfg, 1))


def test_float8_converts_every_linear_but_the_output_head():
    from torchao.float8.float8_linear import Float8Linear

    from meshtrain.models import registry

    model = Llama.from_flavor("debug", meta=True)
    converted = apply_float8(model, skip=registry.get("llama").high_precision)
    assert converted == [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert "output" not in converted and len(converted) == 4 * 7  # wq wk wv wo w1 w2 w3 in each of 4 blocks

    tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(64, 32), "head": torch.nn.Linear(32, 64, bias=False),
                                "body": torch.nn.Linear(32, 32), "odd": torch.nn.Linear(32, 24)})
    tied["head"].weight = tied["embed"].weight
    assert apply_float8(tied, skip=()) == ["body"]  # not the tied head, not a size float8 cannot tile


def test_float8_tp_styles_swap_only_tensorwise_layers_on_cuda():
    """On CUDA the tensorwise float8 layers take torchao's float8 TP styles (their sequence
    all-gathers carry float8); the output head and every style on CPU (gloo has no float8
    collectives) stay as the model's plan says."""
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from meshtrain.parallel.float8 import float8_tp_plan

    model = Llama.from_flavor("debug", meta=True)
    plan = model.tp_plan()
    apply_float8(model, skip=("output",))
    swapped = float8_tp_plan(model, plan, "cuda")
    kinds = {key: type(style) for key, style in swapped.items()}
    assert kinds["layers.0.attention.wq"] is Float8ColwiseParallel
    assert kinds["layers.0.feed_forward.w2"] is Float8RowwiseParallel
    assert kinds["layers.0.attention"] is PrepareFloat8ModuleInput
    assert kinds["layers.0.feed_forward"] is PrepareFloat8ModuleInput
    assert kinds["output"] is ColwiseParallel
    assert float8_tp_plan(model, plan, "cpu") is plan
    rowwise = Llama.from_flavor("debug", meta=True)
    apply_float8(rowwise, skip=("output",), recipe="rowwise")
    assert {type(s) for s in float8_tp_plan(rowwise, plan, "cuda").values()} <= {
        ColwiseParallel, RowwiseParallel, PrepareModuleInput, *{type(s) for s in plan.values()}}


def test_options_that_can_run_pass_the_check():
    cfg = cfg_with("--compile.enable=true", "--compile.loss=true", "--activation_checkpoint.mode=op")
    recipe.check_speed_options(cfg, dims_of(cfg, 1))


# ---------------------------------------------------------------- the benchmark

@pytest.mark.slow
def test_bench_cpu_mode_prints_both_variants_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/throughput.py", "--device", "cpu", "--steps", "2",
                           "--warmup", "1", "--seq-len", "64", "--ac", "op", "--baseline-ac", "none",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)
    assert "plain PyTorch (fully_shard)" in proc.stdout and "meshtrain float32+ac=op" in proc.stdout
    assert "ours / baseline" in proc.stdout and "n/a" in proc.stdout  # no MFU on CPU
    result = json.loads(out.read_text())
    base, ours = result["rows"]
    assert result["peak_bf16_flops"] is None and base["mfu"] is None
    for row in (base, ours):
        assert row["tokens_per_second"] > 0 and row["tflops"] > 0 and row["peak_memory_gib"] > 0
    # Same weights, same data, fp32, and checkpointing changes no math: the same losses.
    assert ours["final_loss"] == pytest.approx(base["final_loss"], rel=1e-6)
    assert ours["activation_mib"] < base["activation_mib"]  # op checkpointing against none


def dims_of(cfg, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world_size=world_size)

