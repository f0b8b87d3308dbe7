"""The GPUs meshtrain knows: peak compute (MFU is measured against it), memory, links.

One table for the planner (`meshtrain plan`), the dry run's "fits" and
training's MFU. Spec figures are the vendors' data sheets (NVIDIA H100, H200, B200 and A100
datasheets: dense bf16 tensor-core FLOP/s, HBM size and bandwidth, NVLink); the measured
ones are `bench.gpu_check`'s (an 8192^3 bf16 matmul: 773-798 TFLOP/s on an H100 SXM,
bench/results/) and device-to-device copies on H100 and H200.
Assumptions, each used only to *rank* layouts, never to promise a number:

- `matmul_efficiency`: the fraction of the bf16 peak a large matmul reaches. Measured
  on H100 (8192^3 bf16: ~798 of 989 TFLOP/s) and H200 (~790); the A100s are not
  measured here and take 0.8 by assumption. A whole training step (attention, norms,
  element-wise ops, smaller TP-sharded matmuls) does worse than one big matmul, so step
  times built on it are optimistic.
- Links: NVLink's "900 GB/s per GPU" is the sum of both directions; a ring collective
  is bound by one direction, so we use half. Inter-node is one InfiniBand NIC per GPU
  (400 Gb/s = 50 GB/s per direction on H100/H200 clusters, 200 Gb/s on A100). Both
  are derated by `link_efficiency` = 0.8 (NCCL's bus bandwidth on large messages is
  typically 75-90% of the line rate; not measured here). How a node's NICs are shared and
  what a collective costs is planning/hardware.py's (the default node: one NIC per GPU).
- Memory: the vendors' "80 GB" / "141 GB" are what torch reports in GiB, less about 1 GiB
  the driver keeps (an H100 80GB shows ~79 GiB); we take the marketed number as GiB,
  and both the planner and the dry run keep `HEADROOM` (10%) free on top: "fits" means
  fits in `usable_bytes(gpu)`, one definition for both.
- `hbm_bandwidth`: what a device-to-device copy reaches (measured on H100 and H200;
  90% of spec assumed for the A100s): the speed of the memory-bound work of a step
  (element-wise ops, the fp32 loss, the optimizer; planning/kernels.py).
- `sms`: streaming multiprocessors, over which a matmul's output tiles run in waves
  (planning/matmul.py). NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 on the
  H100 SXM5, 114 on the PCIe card; the H200 is the same GH100 configuration as the SXM5 (132)
  and the H100 NVL assumed so; NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108;
  B200: 148, what CUDA's device query reports (NVIDIA's B200 datasheet does not state it).
- `attention_efficiency`: the fraction of the bf16 peak torch's flash attention
  (FlashAttention-2 kernels) reaches, forward and backward: 35% on an H100, published
  (Shah et al. 2024, "FlashAttention-3", abstract: "FlashAttention-2 achieving only 35%
  utilization on the H100 GPU"); the same assumed for H200 (the same compute die) and the
  other Hopper cards; 0.6 on A100 (Dao 2023, "FlashAttention-2": 50-73% of the A100's
  peak forward, less backward). `bench/kernel_speeds.py` measures all three on a GPU; where
  physics/kernels/ holds its table, the planner times attention by sequence length from it
  instead (planning/kernels.py `attention_rate`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    device_name: str             # what torch.cuda.get_device_name() contains (longest match wins)
    peak_bf16_flops: float       # dense, no 2:4 sparsity, FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float         # bytes/s, achievable (see above)
    nvlink_bandwidth: float      # bytes/s, one direction, per GPU
    internode_bandwidth: float   # bytes/s, one direction, per GPU (one NIC each)
    matmul_efficiency: float     # fraction of peak_bf16_flops a large matmul reaches
    attention_efficiency: float = 0.35  # fraction of the peak flash attention reaches (see above)
    link_efficiency: float = 0.8
    sms: int = 132               # streaming multiprocessors: the waves of a matmul's tiles (planning/matmul.py)

    @property
    def achievable_flops(self) -> float:
        return self.peak_bf16_flops * self.matmul_efficiency


# name: GPU(model, name in torch's device name, bf16 FLOP/s, memory, achievable copy bandwidth,
#            NVLink one way, inter-node one way, matmul efficiency[, attention efficiency], SMs)
GPUS: dict[str, GPU] = {
    "h100-80gb": GPU("H100 SXM 80GB", "H100", 989e12, 80 * GIB, 3.0e12, 900 * GB / 2, 400e9 / 8, 798 / 989, sms=132),
    # PCIe cards: NVLink bridges join pairs only, so a node's TP group talks over PCIe Gen5 x16.
    "h100-pcie": GPU("H100 PCIe 80GB", "H100 PCIe", 756e12, 80 * GIB, 0.9 * 2.0e12, 64e9, 400e9 / 8, 0.8, sms=114),
    "h100-nvl": GPU("H100 NVL 94GB", "H100 NVL", 835e12, 94 * GIB, 0.9 * 3.9e12, 64e9, 400e9 / 8, 0.8, sms=132),
    "h200-141gb": GPU("H200 SXM 141GB", "H200", 989e12, 141 * GIB, 4.3e12, 900 * GB / 2, 400e9 / 8, 790 / 989, sms=132),
    # B200 (DGX B200 / HGX B200 data sheets): 2.25 PFLOP/s dense bf16 (4.5 with 2:4 sparsity),
    # 180 GB HBM3e at 8 TB/s as DGX B200 exposes it, NVLink 5 at 1.8 TB/s per GPU, eight 400 Gb/s
    # ConnectX-7 NICs. Not measured here: matmul 0.8, copy 90% of spec and attention 35% assumed.
    "b200": GPU("B200 SXM 180GB", "B200", 2250e12, 180 * GIB, 0.9 * 8.0e12, 1800 * GB / 2, 400e9 / 8, 0.8, sms=148),
    "a100-80gb": GPU("A100 SXM 80GB", "A100", 312e12, 80 * GIB, 0.9 * 2.0e12, 600 * GB / 2, 200e9 / 8, 0.8, 0.6,
                      sms=108),
    "a100-40gb": GPU("A100 SXM 40GB", "A100", 312e12, 40 * GIB, 0.9 * 1.6e12, 600 * GB / 2, 200e9 / 8, 0.8, 0.6,
                      sms=108),
}
# What the allocator's peak must leave free: the CUDA context and NCCL's buffers (neither
# is a tensor, so neither is traced or estimated) and the caching allocator's rounding and
# fragmentation. An assumption, not a measurement (bench/results' H100 runs measured the
# allocated peak, 0.2-6.3% below the dry run's traced one, not what a job needs beyond it).
HEADROOM = 0.10

# What a GPU holds that no trace sees, named so the dry run and the estimate can say how
# much of the headroom it takes. Neither is measured here; both are assumptions with sources.
CUDA_CONTEXT = 0.5 * GIB        # the CUDA context, cuBLAS / cuDNN handles with lazy module loading
#                                 (CUDA 12 on H100: a few hundred MiB; torch's docs note it is not in
#                                 memory_allocated)
NCCL_PER_COMMUNICATOR = 4 * 2**20 * 16 * 2   # NCCL_BUFFSIZE's default 4 MiB (NCCL docs) x 16
#                                 channels (assumed) x send and receive, per communicator
# The caching allocator reserves more than the peak it hands out: 10-30% more on one H100
# (max_memory_reserved over max_memory_allocated, bench/results/2026-11-22_h100_run5.json:
# +10% compiled with full AC, +25-30% eager). Reserved memory is reused before a new
# allocation fails, so it is not added; it is why the headroom exists.


def runtime_bytes(communicators: int) -> float:
    """The CUDA context and NCCL's buffers for ``communicators`` process groups."""
    return CUDA_CONTEXT + NCCL_PER_COMMUNICATOR * communicators


def usable_bytes(gpu: "GPU") -> float:
    return (1 - HEADROOM) * gpu.hbm_bytes


ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "h200-141": "h200-141gb", "b200-180gb": "b200"}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise KeyError(f"unknown GPU {name!r}; accepted: {', '.join(GPUS)}")
    return GPUS[key]


def gpu_of_device(device_name: str) -> GPU | None:
    """The row for a ``torch.cuda.get_device_name()``: the longest `device_name` it
    contains, so "NVIDIA H100 PCIe" is not read as an SXM H100. None when unknown."""
    matches = [gpu for gpu in GPUS.values() if gpu.device_name in device_name]
    return max(matches, key=lambda gpu: len(gpu.device_name)) if matches else None

