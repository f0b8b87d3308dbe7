"""Building on meta and initializing shard by shard: the full model never exists on a rank."""

import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshtrain.models.llama import Llama
from meshtrain.parallel import ParallelDims, parallelize
from meshtrain.parallel.init import param_seed
from tests.conftest import ROOT


def local_numel(model) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def test_llama70b_shards_to_one_512th_per_rank_on_meta(fake_world):
    fake_world(512, rank=301)
    start = time.perf_counter()
    mesh = ParallelDims(dp_shard=-1, tp=8).build_mesh("cpu")
    model = parallelize(Llama.from_flavor("70B", meta=True), mesh, sharding_strategy="FULL_SHARD")
    elapsed = time.perf_counter() - start
    total = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
    assert 70.5e9 < total < 70.6e9
    per_rank = local_numel(model)
    # FSDP pads each parameter's last shard: allow a little more than an exact 1/512.
    assert total / 512 <= per_rank * 1.0 + 1 and per_rank <= total / 512 * 1.001, per_rank
    assert all(p.is_meta for p in model.parameters())
    assert elapsed < 60, f"wrapping 70B took {elapsed:.1f}s"


def test_seeds_depend_on_name_not_on_wrappers():
    assert param_seed(0, "layers.3.attention.wq.weight") == param_seed(
        0, "layers.3._checkpoint_wrapped_module.attention.wq.weight")
    assert param_seed(0, "a.weight") != param_seed(1, "a.weight")
    assert param_seed(0, "a.weight") != param_seed(0, "b.weight")


def test_meta_then_init_equals_eager_init():
    eager = Llama.from_flavor("debug")
    lazy = Llama.from_flavor("debug", meta=True)
    lazy.init_weights(seed=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert torch.equal(a, b), name
    # The rotary table is derived, not a parameter: torch's CPU cos may take a vectorized
    # or a scalar path per element depending on how the work is chunked over threads, which
    # can move a value by one float32 ulp. Parameters above are compared bitwise.
    torch.testing.assert_close(eager.rope, lazy.rope, rtol=0, atol=1e-6)


_PEAK_MEMORY_SCRIPT = """
import resource, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from meshtrain.models.llama import Llama
from meshtrain.parallel import ParallelDims, parallelize
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
model = Llama.from_flavor("debug", meta=True, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8,
                          ffn_hidden=4096, vocab_size=65536)
full_bytes = 4 * sum(p.numel() for p in model.parameters())
largest = 4 * max(p.numel() for p in model.parameters())
mesh = ParallelDims(dp_shard=4, tp=2).build_mesh("cpu")
model = parallelize(model, mesh)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model.init_weights(seed=0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(full_bytes, largest, after - before)
"""


@pytest.mark.slow
def test_init_peak_host_memory_is_about_one_parameter_not_the_model():
    proc = subprocess.run([sys.executable, "-c", _PEAK_MEMORY_SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, largest, growth = map(int, proc.stdout.split())
    # Local shards are 1/8 of the model; the transient is one full parameter (+ its slice).
    assert growth < full / 8 + 2.5 * largest, (full, largest, growth)
    assert growth < 0.6 * full, (full, largest, growth)
