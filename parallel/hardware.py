"""GPUs the planner (`python -m parallel.plan`) knows: peak compute, memory, links.

Spec figures are the vendors' data-sheet numbers as collected in ../shared/reference.md
("Hardware"); the measured ones (matmul TFLOP/s, copy bandwidth) are from the same page.
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
  typically 75-90% of the line rate; not measured here).
- Memory: the vendors' "80 GB" / "141 GB" are what torch reports in GiB, less about 1 GiB
  the driver keeps (an H100 80GB shows ~79 GiB); we take the marketed number as GiB,
  and the planner leaves 10% headroom on top (see plan.HEADROOM).
- `hbm_bandwidth`: what a device-to-device copy reaches (measured on H100 and H200;
  90% of spec assumed for the A100s). Only the optimizer step, which is memory-bound,
  uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_flops: float       # dense, no 2:4 sparsity, FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float         # bytes/s, achievable (see above)
    nvlink_bandwidth: float      # bytes/s, one direction, per GPU
    internode_bandwidth: float   # bytes/s, one direction, per GPU (one NIC each)
    matmul_efficiency: float     # fraction of peak_bf16_flops a large matmul reaches
    link_efficiency: float = 0.8

    @property
    def achievable_flops(self) -> float:
        return self.peak_bf16_flops * self.matmul_efficiency

    @property
    def intra_node_bw(self) -> float:
        return self.nvlink_bandwidth * self.link_efficiency

    @property
    def inter_node_bw(self) -> float:
        return self.internode_bandwidth * self.link_efficiency


GPUS: dict[str, GPU] = {
    "h100-80gb": GPU("H100 SXM 80GB", peak_bf16_flops=989e12, hbm_bytes=80 * GIB,
                     hbm_bandwidth=3.0e12, nvlink_bandwidth=900 * GB / 2,
                     internode_bandwidth=400e9 / 8, matmul_efficiency=798 / 989),
    "h200-141gb": GPU("H200 SXM 141GB", peak_bf16_flops=989e12, hbm_bytes=141 * GIB,
                      hbm_bandwidth=4.3e12, nvlink_bandwidth=900 * GB / 2,
                      internode_bandwidth=400e9 / 8, matmul_efficiency=790 / 989),
    "a100-80gb": GPU("A100 SXM 80GB", peak_bf16_flops=312e12, hbm_bytes=80 * GIB,
                     hbm_bandwidth=0.9 * 2.0e12, nvlink_bandwidth=600 * GB / 2,
                     internode_bandwidth=200e9 / 8, matmul_efficiency=0.8),
    "a100-40gb": GPU("A100 SXM 40GB", peak_bf16_flops=312e12, hbm_bytes=40 * GIB,
                     hbm_bandwidth=0.9 * 1.6e12, nvlink_bandwidth=600 * GB / 2,
                     internode_bandwidth=200e9 / 8, matmul_efficiency=0.8),
}
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "h200-141": "h200-141gb"}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise KeyError(f"unknown GPU {name!r}; accepted: {', '.join(GPUS)}")
    return GPUS[key]
