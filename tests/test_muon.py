"""[optimizer] name = "Muon" on one process: meshtrain's optimizer trains like
torch.optim.Muon (the hidden matrices) + torch.optim.AdamW (the rest) in a plain loop
(tests/oracle.py), the split is the documented one, and bad settings are refused in one
line. The sharded layouts are judged the same way in tests/test_parity.py (slow)."""

import pytest
import torch

from meshtrain.models import registry
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config
from meshtrain.training.muon import hidden_matrices
from tests import oracle
from tests.test_parity import hidden_matrix_names, oracle_for
from tests.workers import parity

MUON = parity.MUON  # the debug model at dim 64: tests/workers/parity.py says why
ADAMW = {key: value for key, value in MUON.items() if key != "optimizer"}  # the same model


@pytest.fixture(scope="module")
def one_process():
    return parity.run(None, MUON)


def test_one_process_trains_like_torch_muon_and_adamw(one_process):
    got = one_process
    oracle.assert_matches(got["losses"], got["grad_norms"], got["final"], oracle_for(MUON, got["init"]), "muon")


def test_the_judge_tells_muon_from_adamw(one_process):
    """The same run is far outside the tolerance of the AdamW-only reference: the check
    above sees which optimizer updated the matrices."""
    got = one_process
    with pytest.raises(AssertionError, match="rounding scales from the plain-PyTorch reference"):
        oracle.assert_matches(got["losses"], got["grad_norms"], got["final"], oracle_for(ADAMW, got["init"]), "adamw")


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("llama", dict(tie_embeddings=True)),
                                              ("gpt2", {}), ("moe", {})])
def test_muon_takes_the_hidden_matrices_and_leaves_embeddings_output_and_experts_to_adamw(family, overrides):
    model = parity.build({**overrides, "family": family})
    mine = {id(p) for p in hidden_matrices(model, registry.get(family).output_layer)}
    got = {name for name, p in model.named_parameters() if id(p) in mine}
    assert got == hidden_matrix_names(model)
    assert not any(p.ndim != 2 for p in hidden_matrices(model, registry.get(family).output_layer))


def _refusal(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("text,says", [
    ('[optimizer]\nname = "Muon"\nmuon_momentum = 0.9\n', "unknown key 'muon_momentum' in [optimizer]. Did you mean 'momentum'"),
    ('[optimizer]\nns_steps = 3\n', 'ns_steps = 3 is a Muon setting, read only with [optimizer] name = "Muon"'),
    ('[optimizer]\nname = "Muon"\nadjust_lr_fn = "rms"\n', 'adjust_lr_fn = "rms" is not accepted'),
    ('[optimizer]\nname = "Muon"\nns_steps = 100\n', "ns_steps = 100 is out of range"),
    ('[optimizer]\nname = "Muon"\n[lora]\nenable = true\n', 'name = "Muon" with [lora] enable = true'),
    ('[optimizer]\nname = "Muon"\n[parallelism]\ncpu_offload = true\n', "cpu_offload = true"),
    ('[optimizer]\nname = "muon"\n', 'Did you mean "Muon"'),
])
def test_bad_muon_settings_are_refused_in_one_line_naming_key_and_file(tmp_path, text, says):
    assert says in _refusal(tmp_path, text)


def test_muon_settings_default_to_torchs():
    import inspect

    o = load_config(None, ["--optimizer.name=Muon"]).optimizer
    defaults = {k: v.default for k, v in inspect.signature(torch.optim.Muon).parameters.items()}
    got = o.muon_settings()
    assert got.pop("adjust_lr_fn") == "original" and defaults.pop("adjust_lr_fn") is None  # None means original
    assert got == {k: defaults[k] for k in got}


@pytest.mark.parametrize("mesh_shape,placements", [
    ((8,), "S0"),                # FSDP
    ((2, 4), "SS0 S0"),          # FSDP over TP's rows (a column-wise layer): _StridedShard, Shard
    ((2, 4), "S0 S1"),           # FSDP rows, TP columns (a row-wise layer)
    ((2, 4), "R S0"),            # HSDP
    ((2, 2, 2), "R S0 S1"),      # HSDP x TP
])
def test_each_matrix_reaches_its_owner_in_one_all_to_all_per_sharding_dimension(fake_world, mesh_shape, placements):
    """DTensor's own plan for Muon's redistribution, at Llama 3 8B's 32 layers of 4096 x
    4096: every step shard-to-shard (an all-to-all), none through Replicate (an all-gather),
    both ways. Plain Shard(0) targets would all-gather the TP dimension of row-wise layers."""
    import math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.placement_types import _StridedShard

    from meshtrain.training.muon import _one_dim_in, _owner_placements

    fake_world(math.prod(mesh_shape))
    mesh = init_device_mesh("cpu", mesh_shape)
    word = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(),
            "SS0": _StridedShard(0, split_factor=mesh_shape[-1])}
    matrix = [word[w] for w in placements.split()]
    shape = (32, 4096, 4096)
    meta = TensorMeta(torch.Size(shape), (4096 * 4096, 4096, 1), torch.bfloat16)
    stacked = DTensorSpec(mesh, tuple(_one_dim_in(p) for p in matrix), meta)
    owned = DTensorSpec(mesh, tuple(_owner_placements(mesh, matrix)), meta)
    for src, dst in ((stacked, owned), (owned, stacked)):
        steps = [t.src_dst_placements for t in _gen_transform_infos(src, dst)]
        assert len(steps) == sum(not p.is_replicate() for p in matrix), steps
        assert all(a.is_shard() and b.is_shard() for a, b in steps), steps


@pytest.mark.parametrize("placements", ["S0", "S1", "R", "S0 S1", "R S0"])
def test_sharded_muon_on_dtensors_gives_torch_muons_bits(placements):
    """The stacking, redistribution and unstacking of training/muon.py on a one-rank mesh
    (sharded in name: the grouped path runs): three steps give torch.optim.Muon's weights
    bit for bit, for several matrices of two shapes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshtrain.training.muon import ShardedMuon

    word = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    chosen = [word[w] for w in placements.split()]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,) * len(chosen))
        g = torch.Generator().manual_seed(0)
        shapes = [(48, 32), (32, 48), (48, 32)]
        plain = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, chosen)) for p in plain]
        ours, theirs = ShardedMuon(sharded, lr=0.02), torch.optim.Muon(plain, lr=0.02)
        for _ in range(3):
            for p, q in zip(plain, sharded):
                grad = torch.randn(p.shape, generator=g)
                p.grad, q.grad = grad, distribute_tensor(grad, mesh, chosen)
            ours.step()
            theirs.step()
        for p, q in zip(plain, sharded):
            assert torch.equal(q.full_tensor(), p.detach())
    finally:
        dist.destroy_process_group()
