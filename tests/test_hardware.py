"""The cluster model (planning/hardware.py): collective times against hand arithmetic for
stated sizes and links, the planner's step time wired to it, a TP group larger than a node
priced over the network and said so, and impossible cluster descriptions refused by name.
One process, no GPU."""

import dataclasses

import pytest

from meshtrain.parallel import ParallelDims
from meshtrain.physics.gpus import get_gpu
from meshtrain.planning.estimate import estimate, main as estimate_main
from meshtrain.planning.hardware import Topology, TopologyError, customized, default_topology, load_topology
from meshtrain.planning.plan import resolve_model, run as plan_run
from meshtrain.planning.shape import Job

H100 = get_gpu("h100-80gb")
US = 1e-6
GB = 1e9
# A DGX H100 by its data sheet: NVLink 4 at 900 GB/s per GPU both ways (450 one way), eight
# 400 Gb/s ConnectX-7 NICs (50 GB/s each), 80% of line rate reached; NCCL's Simple-protocol
# latencies: 8.4 us base, 3.4 us per NVLink ring step, 9.6 us per network ring step.
NVLINK, NIC, EFF = 450 * GB, 50 * GB, 0.8


@pytest.mark.parametrize("gpu, nvlink_both_ways", [("h100", 900e9), ("h200", 900e9), ("b200", 1800e9)])
def test_the_default_node_is_a_dgx_with_one_400_gbps_nic_per_gpu(gpu, nvlink_both_ways):
    # DGX H100 / H200 / B200 data sheets: eight 400 Gb/s ConnectX-7 NICs; NVLink 4 / 5.
    net = default_topology(get_gpu(gpu), 8)
    assert (net.gpus_per_node, net.nics_per_node) == (8, 8)
    assert net.nic_bandwidth == pytest.approx(400e9 / 8) and net.nvlink_bandwidth == pytest.approx(nvlink_both_ways / 2)


def test_ring_all_reduce_inside_a_node_by_hand():
    # 8 GPUs, 1 GB: a ring all-reduce takes 2(n-1) = 14 steps and each GPU sends 2(n-1)/n of
    # the tensor over NVLink.
    net = default_topology(H100, 8)
    S = 1 * GB
    by_hand = 8.4 * US + 14 * 3.4 * US + 2 * 7 / 8 * S / (NVLINK * EFF)
    assert net.seconds("all-reduce", S, size=8, stride=1) == pytest.approx(by_hand)
    assert net.algorithm("all-reduce", S, 8) == "nvlink ring"


def test_a_data_parallel_ring_across_nodes_uses_every_nic_of_the_node():
    # FSDP over 16 ranks at TP 1: two nodes, 8 members each. The node's outgoing bytes are
    # one ring's, (n-1)/n of the tensor, spread over its 8 NICs: 8 x 50 GB/s x 0.8 = 320 GB/s
    # per GPU (below NVLink's 360). 15 steps, 1 of them between nodes.
    net = default_topology(H100, 8)
    S = 2 * GB
    by_hand = 8.4 * US + 14 * 3.4 * US + 1 * 9.6 * US + 15 / 16 * S / (8 * NIC * EFF)
    assert net.seconds("all-gather", S, size=16, stride=1) == pytest.approx(by_hand)
    # One NIC per node for the whole node's traffic would be 8x slower: the bug this fixes.
    one_nic = 15 / 16 * S / (NIC * EFF)
    assert net.seconds("all-gather", S, size=16, stride=1) < one_nic / 7
    # At TP 8 each node holds one member of each of 8 groups, which share its 8 NICs: 50 GB/s each.
    by_hand_tp8 = 8.4 * US + 15 * 9.6 * US + 15 / 16 * S / (NIC * EFF)
    assert net.seconds("all-gather", S, size=16, stride=8) == pytest.approx(by_hand_tp8)
    # Four NICs per node: half the bandwidth of the TP 1 ring.
    four = dataclasses.replace(net, nics_per_node=4)
    assert four.seconds("all-gather", S, 16, 1) - by_hand == pytest.approx(15 / 16 * S / (4 * NIC * EFF)
                                                                          - 15 / 16 * S / (8 * NIC * EFF))


def test_all_reduce_switches_to_the_tree_for_small_messages_at_scale():
    # 512 ranks on 64 nodes: a ring pays 2 x 511 hops (126 of them network), a tree
    # 2 x (7 NVLink + log2 64 = 6 network) of NCCL's tree latencies (28 us, 50 us).
    net = default_topology(H100, 8)
    small, big = 1e6, 20e9  # (the ring wins from ~5 GB on, where its 10% better bandwidth repays 3.4 ms)
    ring = lambda S: 8.4 * US + 2 * 448 * 3.4 * US + 126 * 9.6 * US + 2 * 511 / 512 * S / (8 * NIC * EFF)
    tree = lambda S: 8.4 * US + 2 * (7 * 28 + 6 * 50) * US + 2 * S / (0.9 * 8 * NIC * EFF)
    assert net.seconds("all-reduce", small, 512) == pytest.approx(min(ring(small), tree(small)))
    assert net.algorithm("all-reduce", small, 512) == "tree" and tree(small) < ring(small)
    assert net.algorithm("all-reduce", big, 512) == "ring" and ring(big) < tree(big)


def _fsdp_job(nodes, **net):
    job = Job(resolve_model("8B"), H100, nodes, 8, 8192, 16 * nodes)
    return dataclasses.replace(job, topology=dataclasses.replace(job.net, **net)) if net else job


def test_the_estimate_prices_fsdp_with_the_topology():
    # 8B at TP 1, FULL_SHARD over 16 ranks, one micro-batch: per FSDP unit (32 blocks, the
    # embedding, norm + output: 34) an fp32 reduce-scatter, and bf16 gathers: a block's in
    # forward and again in backward, the embedding's and the head's once (parallel/fsdp.py);
    # each collective a ring over both nodes. Computed here from the unit sizes.
    job = _fsdp_job(2)
    lay = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=16, world_size=16, strategy="FULL_SHARD", ac="full",
                       micro_batch=2)
    m = job.model
    local = m.n_params  # untied 8B: every parameter, TP 1
    unit = local / 34
    ends = m.embedding + m.head_split + m.head_replicated  # the embedding's and the head's units
    block = (local - ends) / 32
    bw = 8 * NIC * EFF
    ring = lambda S: 8.4 * US + 14 * 3.4 * US + 9.6 * US + 15 / 16 * S / bw
    by_hand = 32 * 2 * ring(2 * block) + 2 * ring(2 * ends / 2) + 34 * ring(4 * unit)
    assert estimate(job, lay).fsdp_comm_time == pytest.approx(by_hand, rel=1e-9)
    # Half the NICs: the bandwidth part doubles.
    half = estimate(_fsdp_job(2, nics_per_node=4), lay).fsdp_comm_time
    assert half - by_hand == pytest.approx(15 / 16 * (2 * 2 * (local - ends) + 2 * ends + 4 * local) / bw, rel=1e-9)


def test_a_tied_models_embedding_and_head_are_one_fsdp_unit():
    # GPT-2 (tied) at TP 1, FULL_SHARD over 16 ranks on two nodes, one micro-batch:
    # models/common.py makes its embeddings and head one unit, so 12 blocks + 1 = 13
    # collectives a round, the blocks gathered twice, that unit once.
    job = Job(resolve_model("gpt2:124M"), H100, 2, 8, 1024, 32)
    lay = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=16, world_size=16, strategy="FULL_SHARD", ac="none",
                       micro_batch=2)
    m = job.model
    local = m.n_params
    ends = m.embedding + m.head_replicated  # token and position tables, final norm; the head is the table
    block = (local - ends) / 12
    bw = 8 * NIC * EFF
    ring = lambda S: 8.4 * US + 14 * 3.4 * US + 9.6 * US + 15 / 16 * S / bw
    by_hand = 12 * 2 * ring(2 * block) + ring(2 * ends) + 13 * ring(4 * local / 13)
    assert estimate(job, lay).fsdp_comm_time == pytest.approx(by_hand, rel=1e-9)


def test_tp_larger_than_a_node_is_priced_over_the_network_and_warned(capsys):
    # Llama 3 70B at TP 8 on nodes of 4 GPUs (its 8 kv heads allow no more than TP 8).
    job = Job(resolve_model("70B"), H100, 8, 4, 8192, 32)
    lay = ParallelDims(tp=8, pp=1, dp_replicate=1, dp_shard=4, world_size=32, strategy="FULL_SHARD", ac="full",
                       micro_batch=1)
    e = estimate(job, lay)
    assert any("tp=8 spans 2 nodes of 4 GPUs" in w for w in e.warnings)
    # The same layout on 8-GPU nodes keeps TP on NVLink: faster, and no warning.
    inside = estimate(Job(job.model, H100, 4, 8, 8192, 32), lay)
    assert not inside.warnings and inside.times["tp"] < e.times["tp"] / 1.5
    # `meshtrain estimate` prints it.
    assert estimate_main(["--config", "llama70b_2d", "--world-size", "64", "--gpus-per-node", "4"]) == 0
    assert "WARNING: tp=8 spans 2 nodes of 4 GPUs" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ({"nics_per_node": 0}, "nics_per_node = 0 is impossible; it must be at least 1"),
    ({"nic_gbps": -400}, "nic_gbps = -400 is impossible; it must be positive"),
    ({"nvlink_gb_per_s": 0}, "nvlink_gb_per_s = 0 is impossible"),
    ({"link_efficiency": 1.5}, "link_efficiency = 1.5 is impossible"),
    ({"nics_per_node": 2.5}, "nics_per_node = 2.5 must be a whole number"),
    ({"nic_speed": 400}, "unknown key 'nic_speed'; accepted: nics_per_node, nic_gbps"),
    ({"collective_sms": -1}, "collective_sms = -1 is impossible; it must be at least 0"),
    ({"collective_sms": 16.5}, "collective_sms = 16.5 must be a whole number"),
])
def test_impossible_cluster_numbers_are_refused_by_key(change, message):
    with pytest.raises(TopologyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        customized(default_topology(H100, 8), change, "cluster.toml [topology]")
    with pytest.raises(TopologyError, match="nvlink_bandwidth"):
        Topology(gpus_per_node=8, nvlink_bandwidth=-1, nics_per_node=8, nic_bandwidth=1)
    with pytest.raises(TopologyError, match="collective_sms = -1: must be a whole number of at least 0"):
        Topology(gpus_per_node=8, nvlink_bandwidth=1, nics_per_node=8, nic_bandwidth=1, collective_sms=-1)


@pytest.mark.parametrize("change, doubt", [
    ({"nic_gbps": 3200}, "nic_gbps = 3200: faster than any NIC made (1600 Gb/s)"),
    ({"nvlink_gb_per_s": 3600}, "nvlink_gb_per_s = 3600: faster than any NVLink (1800 GB/s)"),
    ({"nics_per_node": 16, "nic_gbps": 1600}, "give each of its 8 GPUs 400 GB/s, more than its NVLink's 100"),
    ({"network_latency_us": 500}, "network_latency_us = 500: each ring step pays it"),
    ({"nvlink_latency_us": 250}, "nvlink_latency_us = 250: each ring step pays it"),
])
def test_numbers_no_cluster_has_are_priced_as_given_and_warned_in_the_estimate(change, doubt):
    # An H100 node with its NVLink written down to 100 GB/s for the third case only.
    base = customized(default_topology(H100, 8), {"nvlink_gb_per_s": 100} if "nics_per_node" in change else {}, "")
    net = customized(base, change, "cluster.toml [topology]")
    assert [d for d in net.doubts() if doubt in d] and len(net.doubts()) == 1
    job = Job(resolve_model("8B"), H100, 2, 8, 8192, 32, topology=net)
    lay = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=16, world_size=16, strategy="FULL_SHARD", ac="full",
                       micro_batch=1)
    assert any(doubt in w for w in estimate(job, lay).warnings)


@pytest.mark.parametrize("gpu", ["h100-80gb", "h200-141gb", "b200", "a100-80gb", "h100-pcie"])
def test_the_default_nodes_raise_no_doubt(gpu):
    assert default_topology(get_gpu(gpu), 8).doubts() == []


def test_a_topology_file_describes_a_cluster_and_the_cli_reports_bad_ones(tmp_path, capsys):
    good = tmp_path / "four_nics.toml"
    good.write_text("[topology]\nnics_per_node = 4\nnic_gbps = 200\n")
    net = load_topology(good, default_topology(H100, 8))
    assert (net.nics_per_node, net.nic_bandwidth) == (4, pytest.approx(25 * GB))
    bad = tmp_path / "bad.toml"
    bad.write_text("[topology]\nnics_per_node = 0\n")
    args = ["--model", "8B", "--nodes", "2", "--seq-len", "8192", "--global-batch", "32"]
    assert plan_run([*args, "--topology", str(bad)]) == 2
    assert f"{bad} [topology]: nics_per_node = 0 is impossible" in capsys.readouterr().err
    assert plan_run([*args, "--nic-gbps", "-1"]) == 2
    assert "--nic-gbps: nic_gbps = -1.0 is impossible" in capsys.readouterr().err
    every_sm = tmp_path / "every_sm.toml"
    every_sm.write_text("[topology]\ncollective_sms = 132\n")
    assert plan_run([*args, "--topology", str(every_sm)]) == 2
    assert f"{every_sm} [topology]: collective_sms = 132 is impossible on H100 SXM 80GB: it has 132 SMs" \
        in capsys.readouterr().err


def test_a_node_without_nvswitch_gives_a_group_only_the_links_to_its_members(tmp_path):
    # An HGX 4-GPU board links its GPUs point to point, 6 of each GPU's 18 NVLinks to each
    # peer: a TP 2 group (or FSDP 2 at stride 2) reaches its partner over a third of the
    # GPU's NVLink, all 4 together over all of it. Through NVSwitches every group has it all.
    switched = default_topology(H100, 4)
    direct = load_topology(_toml(tmp_path, "nvswitch = false"), switched)
    assert not direct.nvswitch and "point to point" in direct.describe()
    for size, stride in ((2, 1), (2, 2), (3, 1)):
        assert direct.bus_bandwidth(size, stride) == pytest.approx(switched.bus_bandwidth(size, stride) * (size - 1) / 3)
    assert direct.bus_bandwidth(4, 1) == switched.bus_bandwidth(4, 1)
    payload = 1e9  # a TP 2 all-gather moves its half at a third of the rate: three times the bytes' time
    bytes_time = lambda net: net.seconds("all-gather", payload, 2) - net.seconds("all-gather", 1.0, 2)
    assert bytes_time(direct) == pytest.approx(3 * bytes_time(switched), rel=1e-6)
    # Across nodes (one member a node) the ring never uses NVLink: the same either way.
    assert direct.bus_bandwidth(2, 4) == switched.bus_bandwidth(2, 4)
    with pytest.raises(TopologyError, match=r"\[topology\]: nvswitch = 0 must be true or false"):
        load_topology(_toml(tmp_path, "nvswitch = 0"), switched)


def _toml(tmp_path, line: str):
    path = tmp_path / f"{abs(hash(line))}.toml"
    path.write_text(f"[topology]\n{line}\n")
    return path


def test_fsdp_traffic_hidden_behind_compute_slows_it_by_the_sms_nccl_holds():
    # 8B at TP 1 over two nodes, FULL_SHARD, two micro-batches: the blocks' gathers and
    # reductions run beside compute. While one runs, NCCL holds collective_sms of the 132
    # SMs (24 by default: an H100's all-gather launches 24 blocks), and compute has the rest.
    lay = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=16, world_size=16, strategy="FULL_SHARD", ac="full",
                       micro_batch=1)
    e = estimate(_fsdp_job(2), lay)
    hidden = e.fsdp_comm_time - e.times["fsdp"]  # all but each micro-batch's first gather and last reduction
    assert 0 < hidden < e.times["compute"]
    assert e.times["contention"] == pytest.approx(hidden * 24 / 132, rel=1e-9)
    idle = estimate(_fsdp_job(2, collective_sms=0), lay)
    assert idle.times["contention"] == 0
    assert idle.step_time == pytest.approx(e.step_time - e.times["contention"], rel=1e-12)
    # One NIC per node: the traffic outlasts the compute, which runs beside it even slowed
    # down; the step is the traffic's, and nothing is added for the SMs.
    thin = estimate(_fsdp_job(2, nics_per_node=1), lay)
    assert thin.fsdp_comm_time > 1.2 * thin.times["compute"] and thin.times["contention"] == 0
    # All the traffic beyond the compute is exposed, each micro-batch's first gather and last
    # reduction counted once among it.
    assert thin.times["fsdp"] == pytest.approx(thin.fsdp_comm_time - thin.times["compute"], rel=1e-9)
    # A topology built in Python with every SM held leaves compute none: refused.
    with pytest.raises(TopologyError, match="collective_sms = 132 is impossible on H100 SXM 80GB: it has 132 SMs"):
        _fsdp_job(2, collective_sms=132)
    # One GPU: no collective, nothing shared.
    one = Job(resolve_model("8B"), H100, 1, 1, 8192, 4)
    alone = ParallelDims(tp=1, pp=1, dp_replicate=1, dp_shard=1, world_size=1, strategy="FULL_SHARD", ac="full",
                         micro_batch=1)
    assert estimate(one, alone).times["contention"] == 0
