"""The mesh builder: rank layout (TP consecutive, FSDP strided, replicas outermost) and
every validation error, checked on a fake process group at real cluster sizes."""

import pytest

from meshtrain.parallel import LayoutError, ParallelDims, check_tp_fits, fsdp_mesh, mesh_coordinate, submesh


def group_of(mesh, name):
    return submesh(mesh, name).mesh.tolist()


@pytest.mark.parametrize("rank", [0, 5, 13])
def test_tp_groups_are_consecutive_ranks_and_fsdp_strides_across_them(fake_world, rank):
    fake_world(16, rank)
    mesh = ParallelDims(dp_replicate=2, dp_shard=2, tp=4).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    node = rank // 8
    tp_start = rank - rank % 4
    assert group_of(mesh, "tp") == list(range(tp_start, tp_start + 4))
    assert group_of(mesh, "dp_shard") == [node * 8 + rank % 4, node * 8 + 4 + rank % 4]
    assert group_of(mesh, "dp_replicate") == [rank % 8, rank % 8 + 8]
    assert sorted(group_of(mesh, "dp")) == sorted(
        r for r in range(16) if r % 4 == rank % 4)
    assert mesh_coordinate(mesh, "tp") == (rank % 4, 4)
    assert mesh_coordinate(mesh, "dp") == ((rank // 4), 4)


def test_pp_is_outermost(fake_world):
    fake_world(8, 6)
    mesh = ParallelDims(pp=2, dp_shard=2, tp=2).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_shard", "tp")
    assert group_of(mesh, "pp") == [2, 6]
    assert group_of(mesh, "tp") == [6, 7]


def test_degree_one_dimensions_are_left_out_of_the_mesh(fake_world):
    fake_world(8)
    mesh = ParallelDims(dp_shard=-1, tp=1).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_shard",)
    assert submesh(mesh, "tp") is None and submesh(mesh, "pp") is None
    assert mesh_coordinate(mesh, "tp") == (0, 1)
    assert submesh(mesh, "dp").size() == 8


@pytest.mark.parametrize("dims, names", [
    (dict(tp=4, dp_shard=1), ("dp_shard", "tp")),
    (dict(pp=2, tp=2, dp_shard=1), ("pp", "dp_shard", "tp")),
    (dict(pp=4, dp_shard=1), ("pp", "dp_shard")),
])
def test_a_one_rank_dp_dimension_goes_in_its_place_for_fsdp_without_data_parallelism(fake_world, dims, names):
    from meshtrain.parallel.mesh import with_one_rank_dp

    fake_world(4, rank=1)
    mesh = ParallelDims(**dims).build_mesh("cpu")
    got = with_one_rank_dp(mesh)
    assert got.mesh_dim_names == names and got["dp_shard"].size() == 1
    assert got.mesh.flatten().tolist() == mesh.mesh.flatten().tolist()  # the same ranks, in order
    assert with_one_rank_dp(got) is got


def test_dp_shard_minus_one_is_inferred_from_world_size():
    assert ParallelDims(dp_shard=-1, tp=8, world_size=512).dp_shard == 64
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, pp=2, world_size=32)
    assert (dims.dp_shard, dims.dp) == (4, 8)


def test_degrees_that_do_not_multiply_to_world_size_show_the_arithmetic():
    with pytest.raises(LayoutError, match=r"2\*1\*3\*2 = 12, but the world size is 8"):
        ParallelDims(pp=2, dp_shard=3, tp=2, world_size=8)


def test_dp_shard_that_cannot_be_inferred_says_why():
    with pytest.raises(LayoutError, match=r"world size 8 is not divisible by pp\*dp_replicate\*tp = 1\*1\*3 = 3"):
        ParallelDims(tp=3, world_size=8)


@pytest.mark.parametrize("field,value", [("tp", 0), ("pp", -2), ("dp_replicate", 0), ("dp_shard", 0), ("dp_shard", -3)])
def test_non_positive_degrees_are_rejected(field, value):
    with pytest.raises(LayoutError, match=f"{field}={value} must be"):
        ParallelDims(**{field: value}, world_size=8)


def test_tp_that_does_not_divide_model_sizes_lists_each_problem():
    with pytest.raises(LayoutError) as err:
        check_tp_fits(3, {"heads": 32, "kv heads": 8, "FFN width": 14336, "vocab size": 128256})
    msg = str(err.value)
    assert "heads (32)" in msg and "kv heads (8)" in msg and "FFN width (14336)" in msg
    assert "vocab" not in msg  # 128256 is divisible by 3


def test_seq_len_must_divide_by_tp_under_sequence_parallel():
    with pytest.raises(LayoutError, match="seq_len=100 is not divisible by tp=8"):
        check_tp_fits(8, {"heads": 64}, seq_len=100, sequence_parallel=True)
    check_tp_fits(8, {"heads": 64}, seq_len=100, sequence_parallel=False)


def test_tp_larger_than_a_node_warns():
    with pytest.warns(UserWarning, match="inter-node"):
        ParallelDims(tp=16, world_size=16).check_model({"heads": 64}, gpus_per_node=8)


def test_full_shard_with_replicas_asks_for_hybrid(fake_world):
    fake_world(8)
    mesh = ParallelDims(dp_replicate=2, dp_shard=4).build_mesh("cpu")
    with pytest.raises(LayoutError, match="use HYBRID_SHARD"):
        fsdp_mesh(mesh, "FULL_SHARD")
    assert fsdp_mesh(mesh, "HYBRID_SHARD").mesh_dim_names == ("dp_replicate", "dp_shard")


def test_hybrid_without_replicas_is_rejected(fake_world):
    fake_world(8)
    mesh = ParallelDims(dp_shard=8).build_mesh("cpu")
    with pytest.raises(LayoutError, match="both must be > 1"):
        fsdp_mesh(mesh, "HYBRID_SHARD")
    with pytest.raises(LayoutError, match="accepted: FULL_SHARD"):
        fsdp_mesh(mesh, "ZERO3")


def test_no_shard_replicates_over_every_data_parallel_rank(fake_world):
    fake_world(8)
    mesh = ParallelDims(dp_shard=4, tp=2).build_mesh("cpu")
    ddp = fsdp_mesh(mesh, "NO_SHARD")
    assert ddp.shape == (4, 1)


def test_process_group_size_must_match(fake_world):
    fake_world(8)
    with pytest.raises(LayoutError, match="sized for world size 4"):
        ParallelDims(dp_shard=4, world_size=4).build_mesh("cpu")
