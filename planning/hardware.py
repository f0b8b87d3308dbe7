"""The cluster as it is built: GPUs per node, NVLink inside a node, NICs between nodes, and
the time of a collective on it, latency (alpha) plus bytes over bandwidth (beta), for the
algorithm NCCL would pick.

    net = default_topology(get_gpu("h100"), gpus_per_node=8)     # a DGX / HGX H100 node
    net.seconds("all-gather", payload_bytes, size=64, stride=1)   # one FSDP gather of 64 ranks

Defaults (`default_topology`), from the vendors' system data sheets: DGX H100 and DGX H200
have 8 GPUs joined by NVLink 4 / NVSwitch (900 GB/s per GPU, both directions) and eight
single-port ConnectX-7 NICs of 400 Gb/s for the compute fabric, one per GPU; DGX B200 the
same eight ConnectX-7 with NVLink 5 (1.8 TB/s per GPU); DGX A100 eight ConnectX-6 of
200 Gb/s with NVLink 3 (600 GB/s). HGX boards in the usual cloud instances are built the
same way. So the default is one NIC per GPU at the GPU row's `internode_bandwidth`
(physics/gpus.py); a cluster built otherwise says so (`--nics-per-node`, `--nic-gbps`, or a
`--topology` file: `load_topology`).

The model of a group of ``size`` ranks, ``stride`` apart in rank order (tp innermost,
parallel/mesh.py), on nodes of ``gpus_per_node``:

- Inside one node: a ring over NVLink, each GPU sending at the NVLink speed.
- Across nodes: NCCL's rings cross each node boundary once per channel and spread their
  channels over every NIC of the node, so the bytes a node sends for one ring collective
  are those of one ring, (n - 1)/n of the payload, over *all* its NICs: NVLink inside the
  node, every NIC between nodes (the hierarchical bandwidth). Every GPU of the node is in
  some group of the same mesh dimension and they all run at once (data parallelism reduces
  everywhere together), so the node's NICs are shared by gpus_per_node / members-per-node
  groups. A GPU's share: nics x nic_bandwidth x members-per-node / gpus_per_node, at most
  its NVLink speed. (Charging every cross-node ring at one NIC's speed would make a TP 1
  FSDP group of 8 ranks per node 8x too slow on a node with 8 NICs.)
- Latency, NCCL's own tuning model (src/graph/tuning.cc, the Simple protocol of large
  messages): a ring collective pays a base latency plus one hop latency per step, NVLink
  hops for steps inside a node and network hops for the (nodes - 1) steps between nodes;
  all-gather and reduce-scatter take n - 1 steps, all-reduce 2(n - 1). An all-reduce may
  instead run as NCCL's tree: 2 x ((members per node - 1) NVLink hops + log2(nodes) network
  hops), its bandwidth 0.9x the ring's bus bandwidth for twice the payload (NCCL's tree
  algorithm bandwidth is half its bus bandwidth, x 0.9). NCCL picks by size and scale;
  `seconds` takes the faster, as NCCL's tuner does.
- Point to point (pipeline sends): the bytes leaving the node share the node's NICs the
  same way, one base + one hop latency. All-to-all (context and expert parallelism): each
  rank sends 1/n of its input to every peer, over NVLink inside its node and, at the same
  time, through the NICs to the peers in other nodes; every remote byte crosses a NIC, and
  all GPUs of a node exchange at once, so each gets 1 / gpus_per_node of the node's NICs.
- SMs: a running collective holds `collective_sms` of the GPU's SMs (one per NCCL channel),
  so compute that overlaps it runs on the rest (planning/step_time.py, contention).

Bandwidths are derated by `link_efficiency` (0.8: NCCL's bus bandwidth on large messages
is typically 75-90% of the line rate; physics/gpus.py). Not modelled: NVLink SHARP / NVLS and
InfiniBand SHARP (in-network reductions), rail-optimized versus fat-tree switch fabrics,
congestion between jobs, the LL / LL128 protocols of small messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from meshtrain.physics.gpus import GPU

US = 1e-6
# NCCL src/graph/tuning.cc, Simple protocol (the one of large messages), microseconds:
# baseLat ring 8.4; hwLat ring NVLink 3.4, network 9.6 per step; tree NVLink 28, network 50.
BASE_LATENCY = 8.4 * US
TREE_NVLINK_LATENCY = 28 * US
TREE_NETWORK_LATENCY = 50 * US
TREE_BANDWIDTH = 0.9          # NCCL: tree bus bandwidth x 0.9
# A running NCCL collective holds one SM per channel: each channel is a thread block of up
# to 640 threads (NCCL_MAX_NTHREADS) whose registers fill an SM, so compute overlapping it
# runs on the other SMs. NCCL picks the channel count from the topology, at most 32
# (MAXCHANNELS), fewer where the links are fewer. On an H100 whose all-gather overlaps a
# GEMM as FSDP's prefetch does, Nsight shows ncclAllGather launching 24 blocks (NVIDIA
# developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation
# because of Tail Effect"); an 8-GPU HGX A100's rings are 24 channels (NVIDIA/nccl-tests#100);
# 16 is an H800 node's (NVIDIA/nccl#892), whose NVLink has 8 links where an H100's has 18.
# 24 of an H100's 132 SMs is 18%, as measured independently: overlapping compute with
# communication slowed it by 18.9% on average (A100, H100, MI250, MI210; arXiv 2507.03114).
COLLECTIVE_SMS = 24


# Beyond these a number is possible to write but not to buy (late 2026): said in the
# estimate's output, since a unit slip (GB/s for Gb/s, both directions for one) is the likely cause.
FASTEST_NIC = 1600e9 / 8       # bytes/s: ConnectX-9 (Vera Rubin), 1.6 Tb/s; ConnectX-8 800 Gb/s
FASTEST_NVLINK = 1800e9        # bytes/s per GPU, one direction: NVLink 6 (Rubin); NVLink 5 (B200) is 900
SLOWEST_HOP = 100 * US         # per ring step: NCCL's own are 3.4 (NVLink) and 9.6 (network)


class TopologyError(ValueError):
    """A cluster description with impossible numbers; the message names the key."""


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nvlink_bandwidth: float        # bytes/s, one direction, per GPU (line rate)
    nics_per_node: int
    nic_bandwidth: float           # bytes/s, one direction, per NIC (line rate)
    link_efficiency: float = 0.8   # the fraction of the line rate NCCL reaches on large messages
    nvlink_latency: float = 3.4 * US    # per ring step inside a node (NCCL hwLat, NVLink, ring, Simple)
    network_latency: float = 9.6 * US   # per ring step between nodes (NCCL hwLat, NET, ring, Simple)
    collective_sms: int = COLLECTIVE_SMS  # SMs a running collective holds: compute beside it has the rest
    # The node's GPUs joined through NVSwitches (DGX / HGX 8-GPU): any group inside it sends
    # at its full NVLink rate. False: linked point to point, each pair by an equal share of
    # a GPU's links (HGX 4-GPU boards, whose 18 links per GPU go 6 to each of 3 peers): a
    # group reaches only the links to its own members (`nvlink_share`).
    nvswitch: bool = True

    def __post_init__(self):
        for key in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"{key} = {value!r}: must be a whole number of at least 1")
        for key in ("nvlink_bandwidth", "nic_bandwidth"):
            if not getattr(self, key) > 0:
                raise TopologyError(f"{key} = {getattr(self, key)!r}: must be a positive bandwidth")
        if not 0 < self.link_efficiency <= 1:
            raise TopologyError(f"link_efficiency = {self.link_efficiency!r}: must be in (0, 1]")
        if not isinstance(self.collective_sms, int) or isinstance(self.collective_sms, bool) or self.collective_sms < 0:
            raise TopologyError(f"collective_sms = {self.collective_sms!r}: must be a whole number of at least 0")
        for key in ("nvlink_latency", "network_latency"):
            if not getattr(self, key) >= 0:
                raise TopologyError(f"{key} = {getattr(self, key)!r}: must be a latency of at least 0")
        if not isinstance(self.nvswitch, bool):
            raise TopologyError(f"nvswitch = {self.nvswitch!r}: must be true or false")

    def doubts(self) -> list[str]:
        """Numbers no cluster has, each in one line naming its file key: the estimate
        prices them as given, and the plan's output warns."""
        out = []
        if self.nic_bandwidth > FASTEST_NIC:
            out.append(f"nic_gbps = {self.nic_bandwidth * 8 / 1e9:g}: faster than any NIC made "
                       f"({FASTEST_NIC * 8 / 1e9:.0f} Gb/s); it is one port's line rate in gigabits per second")
        if self.nvlink_bandwidth > FASTEST_NVLINK:
            out.append(f"nvlink_gb_per_s = {self.nvlink_bandwidth / 1e9:g}: faster than any NVLink "
                       f"({FASTEST_NVLINK / 1e9:.0f} GB/s); it is one GPU's rate in one direction (an H100's: 450)")
        network = self.nics_per_node * self.nic_bandwidth / self.gpus_per_node
        if network > self.nvlink_bandwidth:
            out.append(f"the node's NICs ({self.nics_per_node} x {self.nic_bandwidth * 8 / 1e9:g} Gb/s) give each of "
                       f"its {self.gpus_per_node} GPUs {network / 1e9:.0f} GB/s, more than its NVLink's "
                       f"{self.nvlink_bandwidth / 1e9:.0f}: a GPU's share of the network is capped at NVLink's")
        for key, value in (("nvlink_latency_us", self.nvlink_latency), ("network_latency_us", self.network_latency)):
            if value > SLOWEST_HOP:
                out.append(f"{key} = {value / US:g}: each ring step pays it (NCCL's own: 3.4 over NVLink, 9.6 "
                           f"over the network); it is in microseconds")
        return out

    # ------------------------------------------------------------ where a group sits

    def members_per_node(self, size: int, stride: int) -> int:
        """How many of a group's ``size`` ranks share one node (all of them when the group
        fits in a node; 1 when its ranks are a node or more apart)."""
        if size * stride <= self.gpus_per_node:
            return size
        return max(1, min(size, self.gpus_per_node // stride))

    def nodes_spanned(self, size: int, stride: int) -> int:
        return math.ceil(size / self.members_per_node(size, stride))

    def nvlink_share(self, local: int) -> float:
        """Bytes/s a GPU reaches the other ``local`` - 1 members of its group in its node at:
        its whole NVLink through NVSwitches; linked point to point, only its links to those
        peers, (local - 1) / (gpus_per_node - 1) of them (NCCL's rings and all-to-alls run
        over the direct links; routing through a third GPU is not modelled)."""
        full = self.nvlink_bandwidth * self.link_efficiency
        if self.nvswitch or local <= 1 or self.gpus_per_node <= 2:
            return full
        return full * (local - 1) / (self.gpus_per_node - 1)

    def bus_bandwidth(self, size: int, stride: int) -> float:
        """Bytes/s one GPU of the group sends at in a ring (or any exchange whose bytes are
        spread evenly): NVLink inside a node (`nvlink_share`); across nodes its share of the
        node's NICs, shared with the node's other groups of the same dimension, at most NVLink."""
        local = self.members_per_node(size, stride)
        nvlink = self.nvlink_share(local)
        if self.nodes_spanned(size, stride) == 1:
            return nvlink
        network = self.nics_per_node * self.nic_bandwidth * self.link_efficiency * local / self.gpus_per_node
        return min(nvlink, network)

    # ------------------------------------------------------------ the collectives

    def ring_seconds(self, kind: str, payload: float, size: int, stride: int) -> float:
        """A ring all-gather / reduce-scatter (payload: the whole gathered tensor) or
        all-reduce (payload: the tensor): steps x hop latency + bytes sent / bus bandwidth."""
        steps = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}[kind]
        nodes = self.nodes_spanned(size, stride)
        inter = steps * (nodes - 1)
        intra = steps * (size - 1) - inter
        latency = BASE_LATENCY + intra * self.nvlink_latency + inter * self.network_latency
        return latency + steps * payload * (size - 1) / size / self.bus_bandwidth(size, stride)

    def tree_seconds(self, payload: float, size: int, stride: int) -> float:
        """NCCL's (double binary) tree all-reduce: a chain inside each node, a tree over the
        nodes, up and down."""
        local, nodes = self.members_per_node(size, stride), self.nodes_spanned(size, stride)
        latency = BASE_LATENCY + 2 * ((local - 1) * TREE_NVLINK_LATENCY
                                      + math.ceil(math.log2(nodes)) * TREE_NETWORK_LATENCY)
        return latency + 2 * payload / (TREE_BANDWIDTH * self.bus_bandwidth(size, stride))

    def seconds(self, kind: str, payload: float, size: int, stride: int = 1) -> float:
        """Seconds of one collective of ``kind`` on a group of ``size`` ranks ``stride``
        apart. ``payload``: the whole tensor for all-gather (its output), reduce-scatter (its
        input) and all-reduce; the bytes sent for "send/recv"; the input for "all-to-all"."""
        if size <= 1 or payload <= 0:
            return 0.0
        if kind in ("all-gather", "reduce-scatter"):
            return self.ring_seconds(kind, payload, size, stride)
        if kind == "all-reduce":
            return min(self.ring_seconds(kind, payload, size, stride), self.tree_seconds(payload, size, stride))
        hop = self.network_latency if self.nodes_spanned(size, stride) > 1 else self.nvlink_latency
        if kind == "send/recv":
            return BASE_LATENCY + hop + payload / self.bus_bandwidth(size, stride)
        if kind == "all-to-all":
            return BASE_LATENCY + hop + self.all_to_all_transfer(payload, size, stride)
        raise ValueError(f"unknown collective {kind!r}")

    def all_to_all_transfer(self, payload: float, size: int, stride: int) -> float:
        """Seconds one rank's all-to-all of ``payload`` input bytes moves data: it keeps 1/n,
        sends 1/n to each peer, over NVLink to the peers of its node and through the NICs
        to the others, both at once. Unlike a ring, an all-to-all takes every remote byte of
        every GPU over the network: all the node's GPUs exchange at once (every one is in a
        group of the dimension), so each gets 1 / gpus_per_node of the node's NICs."""
        local = self.members_per_node(size, stride)
        nvlink = self.nvlink_share(local)
        inside = payload * (local - 1) / size / nvlink
        if local == size:
            return inside
        nic = self.nics_per_node * self.nic_bandwidth * self.link_efficiency / self.gpus_per_node
        return max(inside, payload * (size - local) / size / min(nvlink, nic))

    def algorithm(self, kind: str, payload: float, size: int, stride: int = 1) -> str:
        """The algorithm `seconds` charged: "nvlink ring", "ring", "tree", ... (for reports)."""
        where = "nvlink " if self.nodes_spanned(size, stride) == 1 else ""
        if kind == "all-reduce" and self.tree_seconds(payload, size, stride) < self.ring_seconds(kind, payload, size,
                                                                                                   stride):
            return where + "tree"
        return where + ("ring" if kind in ("all-gather", "reduce-scatter", "all-reduce") else kind)

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node, NVLink {self.nvlink_bandwidth / 1e9:.0f} GB/s per GPU"
                f"{'' if self.nvswitch else ' (point to point: no NVSwitch)'}, "
                f"{self.nics_per_node} NICs x {self.nic_bandwidth * 8 / 1e9:.0f} Gb/s per node "
                f"(x {self.link_efficiency:.0%} reached)")


def default_topology(gpu: GPU, gpus_per_node: int) -> Topology:
    """A DGX / HGX-class node of ``gpu``: one NIC per GPU (see the module's docstring)."""
    return Topology(gpus_per_node=gpus_per_node, nvlink_bandwidth=gpu.nvlink_bandwidth,
                    nics_per_node=gpus_per_node, nic_bandwidth=gpu.internode_bandwidth,
                    link_efficiency=gpu.link_efficiency)


# The keys of a topology file's [topology] table, in the units a data sheet states them.
FILE_KEYS = {
    "nics_per_node": ("nics_per_node", 1, int),
    "nic_gbps": ("nic_bandwidth", 1e9 / 8, float),            # Gb/s, line rate, one direction
    "nvlink_gb_per_s": ("nvlink_bandwidth", 1e9, float),      # GB/s, one direction, per GPU
    "link_efficiency": ("link_efficiency", 1, float),
    "nvlink_latency_us": ("nvlink_latency", US, float),
    "network_latency_us": ("network_latency", US, float),
    "collective_sms": ("collective_sms", 1, int),             # SMs a running collective holds
    "nvswitch": ("nvswitch", 1, bool),                        # false: GPUs linked point to point (HGX 4-GPU)
}


def customized(base: Topology, values: dict, where: str) -> Topology:
    """``base`` with the FILE_KEYS in ``values`` replaced; TopologyError naming ``where``
    (the file or the flag) for an unknown key, a wrong type or an impossible number."""
    changes = {}
    for key, value in values.items():
        if key not in FILE_KEYS:
            raise TopologyError(f"{where}: unknown key {key!r}; accepted: {', '.join(FILE_KEYS)}")
        name, unit, kind = FILE_KEYS[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise TopologyError(f"{where}: {key} = {value!r} must be true or false")
            changes[name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise TopologyError(f"{where}: {key} = {value!r} must be a{' whole' if kind is int else ''} number")
        zero_ok = key.endswith("latency_us") or key == "collective_sms"
        least = 0 if zero_ok else (1 if kind is int else 0)
        if value < least or (value == 0 and not zero_ok):
            what = "at least 0" if zero_ok else ("at least 1" if kind is int else "positive")
            raise TopologyError(f"{where}: {key} = {value!r} is impossible; it must be {what}")
        if key == "link_efficiency" and value > 1:
            raise TopologyError(f"{where}: link_efficiency = {value!r} is impossible; it must be in (0, 1]")
        changes[name] = int(value) if kind is int else float(value) * unit
    try:
        return Topology(**{f.name: getattr(base, f.name) for f in fields(Topology)} | changes)
    except TopologyError as err:
        raise TopologyError(f"{where}: {err}") from None


def load_topology(path: str | Path, base: Topology) -> Topology:
    """A cluster described in a TOML file's [topology] table (keys: FILE_KEYS), over the
    defaults of ``base``. docs/planning.md, "Your cluster", shows one."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"--topology {path}: no such file") from None
    except tomllib.TOMLDecodeError as err:
        raise TopologyError(f"--topology {path}: not TOML: {err}") from None
    table = data.get("topology")
    if not isinstance(table, dict) or set(data) != {"topology"}:
        raise TopologyError(f"{path}: expected one [topology] table with keys {', '.join(FILE_KEYS)}")
    return customized(base, table, f"{path} [topology]")


def add_arguments(parser) -> None:
    """The command-line flags that describe a cluster (`meshtrain plan`, `meshtrain estimate`)."""
    parser.add_argument("--topology", metavar="FILE.toml",
                        help="the cluster's links as a [topology] table (docs/planning.md, Your cluster)")
    parser.add_argument("--nics-per-node", type=int, help="inter-node NICs per node (default: one per GPU)")
    parser.add_argument("--nic-gbps", type=float, help="each NIC's line rate, Gb/s (default: the GPU's, 400 on H100)")


def from_arguments(args, gpu: GPU, gpus_per_node: int) -> Topology:
    """The topology the flags describe: the default node of ``gpu``, then the file, then
    --nics-per-node / --nic-gbps. TopologyError names the flag or file key that is wrong."""
    net = default_topology(gpu, gpus_per_node)
    if args.topology:
        net = load_topology(args.topology, net)
    for flag, key in (("nics_per_node", "nics_per_node"), ("nic_gbps", "nic_gbps")):
        value = getattr(args, flag)
        if value is not None:
            net = customized(net, {key: value}, f"--{flag.replace('_', '-')}")
    check_collective_sms(net, gpu, f"{args.topology} [topology]: " if args.topology else "")
    return net


def check_collective_sms(net: Topology, gpu: GPU, where: str = "") -> None:
    """The SMs collectives hold must leave compute some of ``gpu``'s: TopologyError otherwise,
    prefixed with ``where`` (the file that set it)."""
    if net.collective_sms >= gpu.sms:
        raise TopologyError(f"{where}collective_sms = {net.collective_sms} is impossible on "
                            f"{gpu.name}: it has {gpu.sms} SMs, and compute needs some")
