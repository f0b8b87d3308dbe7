"""Choosing FSDP units for a model that does not list its own, and parallelizing one."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.parallel import ParallelDims, modules_to_wrap, parallelize


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)          # 2*dim params
        self.up = nn.Linear(dim, hidden)       # dim*hidden + hidden
        self.down = nn.Linear(hidden, dim)     # hidden*dim + dim

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UserModel(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, hidden: int = 32, n_blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_block_classes_gives_the_blocks_in_model_order():
    model = UserModel(n_blocks=3)
    assert modules_to_wrap(model, block_classes=(Block,)) == list(model.blocks)


def test_min_num_params_is_bottom_up_and_counts_only_unclaimed_params():
    # Per block (dim 8, hidden 32): up 288, down 264, norm 16 -> 568 in all.
    model = UserModel()
    b0, b1 = model.blocks
    # up (288) is claimed first; its block then has 264 + 16 = 280 left, just enough.
    assert modules_to_wrap(model, min_num_params=280) == [b0.up, b0, b1.up, b1]
    # One more and the block is not wrapped despite holding 568: up's 288 no longer count.
    model = UserModel(n_blocks=1)
    assert modules_to_wrap(model, min_num_params=281) == [model.blocks[0].up]


def test_min_num_params_never_picks_a_container():
    model = UserModel()  # the blocks' leftovers (2 x 280) add up in the ModuleList
    units = modules_to_wrap(model, min_num_params=281)
    assert not any(isinstance(u, (nn.ModuleList, nn.ModuleDict)) for u in units)


def test_exactly_one_policy():
    model = UserModel()
    with pytest.raises(ValueError, match="exactly one"):
        modules_to_wrap(model)
    with pytest.raises(ValueError, match="exactly one"):
        modules_to_wrap(model, block_classes=(Block,), min_num_params=100)


def test_absent_block_class_is_named():
    with pytest.raises(ValueError, match="GRU"):
        modules_to_wrap(UserModel(), block_classes=(nn.GRU,))


def test_parallelize_user_model_on_meta(fake_world):
    fake_world(8)
    mesh = ParallelDims(dp_shard=4, tp=2).build_mesh("cpu")
    with torch.device("meta"):
        model = UserModel()
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    model = parallelize(model, mesh, tp_plan=plan, block_classes=(Block,))

    assert isinstance(model, FSDPModule)
    for block in model.blocks:
        assert isinstance(block, FSDPModule)
        for linear, tp_shard in ((block.up, Shard(0)), (block.down, Shard(1))):
            w = linear.weight
            assert isinstance(w, DTensor)
            assert w.device_mesh.mesh_dim_names == ("dp_shard", "tp")
            assert w.placements[1] == tp_shard, w.placements
        # Not in the TP plan: sharded by FSDP alone.
        assert block.norm.weight.device_mesh.mesh_dim_names == ("dp_shard",)
    assert all(p.is_meta for p in model.parameters())
