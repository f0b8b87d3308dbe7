"""Which op-level activation checkpointing policy trains fastest, in bf16 and float8.

    python -m bench.ac_policy --device cuda --layers 10 [--profile out.txt]

meshtrain's ``ac = "op"`` keeps every matmul, attention and collective output and
recomputes the element-wise ops in between (parallel/activation_checkpoint.py). Under
float8 two more choices matter, and this benchmark times them on the same model, step and
settings as bench/throughput.py (compiled blocks and loss, one rank):

- ``amax``: also keep ``aten.max`` -- the absolute maximum each float8 cast computes for
  its scale. A scalar to keep; recomputing it re-reads the whole activation.
- ``every-second-mm``: keep the amax and only every second matmul, leaving the others to
  the compiler's partitioner (``PREFER_RECOMPUTE``): torchtitan's policy, which saves
  memory that the partitioner may spend on cheaper saves (e.g. float8 casts, half the bytes
  of their bf16 source).

Each row is built, warmed up and timed in turn; the table prints tokens/s, MFU and peak
memory with the ratio to the first row of the same precision.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import CheckpointPolicy

from bench import throughput
from meshtrain.parallel import activation_checkpoint as ac

POLICIES = ("default", "amax", "every-second-mm")


def policy(name: str):
    """The checkpoint policy function for ``name`` (the default is meshtrain's own)."""
    if name == "default":
        return ac.save_expensive_ops
    saved = ac.SAVED_OPS | {torch.ops.aten.max.default}
    if name == "amax":
        return lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    counts = defaultdict(int)
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default}

    def every_second(ctx, op, *args, **kwargs):
        if op in matmuls:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return every_second


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--precisions", default="bf16,float8")
    p.add_argument("--profile", type=Path, default=None, help="append each row's top device ops here")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train.py does
    gpu = args.device == "cuda"
    seq = args.seq_len or (8192 if gpu else 128)
    store_file = throughput.init_world(args.device)
    device = torch.device(args.device, torch.cuda.current_device()) if gpu else torch.device("cpu")
    mesh = init_device_mesh(args.device, (1,), mesh_dim_names=("dp_shard",))
    rows = []
    for precision in args.precisions.split(","):
        for name in args.policies.split(","):
            argv = ["--device", args.device, "--flavor", "8B" if gpu else "debug", "--layers", str(args.layers),
                    "--seq-len", str(seq), "--batch", "1", "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--dtype", "bfloat16" if gpu else "float32", "--ac", "op", "--compile", "--compile-loss"]
            argv += ["--float8"] if precision == "float8" else []
            targs = throughput.parse_args(argv)
            shape = throughput.new_model(targs)
            flops = throughput.model_flops_per_token(shape, seq)
            peak = throughput.device_peak_flops(device)
            ac.save_expensive_ops, original = policy(name), ac.save_expensive_ops  # apply_ac reads it at call time
            try:
                row = throughput.measure(f"{precision} ac=op {name}", throughput.build_meshtrain, targs, mesh, device,
                                         flops, peak, True, profile_to=args.profile)
            finally:
                ac.save_expensive_ops = original
            row.update(precision=precision, policy=name)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("name", "tokens_per_second", "mfu", "peak_memory_gib",
                                                       "error")}), flush=True)
    first = {}
    for row in rows:
        base = first.setdefault(row["precision"], row)
        tps, ref = row.get("tokens_per_second"), base.get("tokens_per_second")
        row["ratio_to_default"] = tps / ref if tps and ref else None
    result = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
              "layers": args.layers, "seq_len": seq, "rows": rows}
    print(f"{'row':32} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs default':>10}")
    for row in rows:
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "n/a"
        print(f"{row['name']:32} {row.get('tokens_per_second', 0):10.0f} {mfu:>7} "
              f"{row.get('peak_memory_gib') or 0:9.1f} {row.get('ratio_to_default') or 0:10.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    throughput.shutdown_distributed()
    if store_file:
        Path(store_file).unlink(missing_ok=True)
    return result


if __name__ == "__main__":
    main()
