"""Async tensor parallelism: overlap each TP collective with the matmul next to it.

Under sequence parallelism every TP Linear is an all-gather followed by a matmul
(column-wise) or a matmul followed by a reduce-scatter (row-wise), and the GPU waits for
the collective. Inductor's micro-pipeline pass splits such pairs into chunks and runs
chunk i's communication while chunk i-1 multiplies, using symmetric memory (peer-to-peer
buffers over NVLink) for the transfers. So it needs three things: CUDA, torch.compile
(it is a compiler pass, applied only inside compiled blocks) and a tp dimension.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh


def async_tp_unavailable(device_type: str, *, compile: bool, tp: int) -> str | None:
    """Why async TP cannot run here, naming every missing piece; None when it can."""
    missing = []
    if device_type != "cuda" or not torch.cuda.is_available():
        missing.append(f"it needs CUDA (symmetric memory over NVLink); this run is on {device_type}")
    if not compile:
        missing.append("it is a torch.compile pass, so [compile] enable must be true")
    if tp < 2:
        missing.append(f"it overlaps tensor-parallel collectives, so tp must be > 1 (got tp = {tp})")
    return "; ".join(missing) or None


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn the pass on for every later compilation, and give the TP group symmetric memory."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    # torch 2.13 marks this call deprecated, yet its pass still fuses only the groups
    # registered through it (is_symm_mem_enabled_for_group), so it is still required.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
