"""float8's speed-up over bf16, with one and with several micro-batches a step.

    python -m bench.float8_speedup --device cuda --layers 10 [--accum 1,8] [--recipe tensorwise]

float8 speeds up the blocks' matmuls only. On one GPU with one sequence a step, the work
done once per parameter -- AdamW over every weight, clipping, FSDP's copies -- is a third of
the step and does not change, which caps the gain (docs/benchmarks.md, "Where float8's time
goes"). On N GPUs each rank steps 1/N of the optimizer; ``--accum N`` spreads it over N
micro-batches instead, so one GPU shows the ratio a many-GPU step would.

Each row is meshtrain's compiled, op-checkpointed step (bench/throughput.py's options), run
in a fresh process (`python -m bench.peer_torchtitan --side meshtrain`), in the order bf16,
float8, float8, bf16 for each ``--accum``: in one process a later run can measure several
percent slower than a first one, so each run starts clean and the order is balanced.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.peer_torchtitan import run_side

ORDER = ("bf16", "float8", "float8", "bf16")


def measure(device: str, layers: int, accums: list[int], recipe: str, steps: int, warmup: int,
            seq_len: int | None = None) -> dict:
    gpu = device == "cuda"
    result = {"order": ", ".join(ORDER) + " per accum, each a fresh process", "recipe": recipe, "rows": []}
    for accum in accums:
        runs = {"bf16": [], "float8": []}
        for precision in ORDER:
            argv = ["--device", device, "--flavor", "8B" if gpu else "debug", "--layers", str(layers),
                    "--seq-len", str(seq_len or (8192 if gpu else 128)), "--batch", "1", "--accum", str(accum),
                    "--steps", str(steps), "--warmup", str(warmup), "--dtype", "bfloat16" if gpu else "float32",
                    "--ac", "op", "--compile", "--compile-loss"]
            argv += ["--float8", "--float8-recipe", recipe] if precision == "float8" else []
            runs[precision].append(run_side("meshtrain", argv))
        mean = {k: sum(r["tokens_per_second"] for r in v) / len(v) for k, v in runs.items()}
        row = {"accum": accum, "bf16_tokens_per_second": mean["bf16"], "float8_tokens_per_second": mean["float8"],
               "speedup": mean["float8"] / mean["bf16"], "runs": runs,
               "peak_memory_gib": {k: max(r.get("peak_memory_gib") or 0 for r in v) for k, v in runs.items()}}
        result["rows"].append(row)
        print(f"float8_speedup: accum {accum}: bf16 {mean['bf16']:,.0f}, float8 {mean['float8']:,.0f} tokens/s, "
              f"{row['speedup']:.3f}x", flush=True)
    return result


def markdown(result: dict) -> list[str]:
    lines = [f"| micro-batches a step | bf16 tokens/s | float8 {result['recipe']} tokens/s | float8 / bf16 |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['accum']} | {r['bf16_tokens_per_second']:,.0f} | {r['float8_tokens_per_second']:,.0f} | "
              f"{r['speedup']:.3f}x |" for r in result["rows"]]
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=None, help="default: 8192 on GPU, 128 on CPU")
    p.add_argument("--accum", default="1,8", help="comma-separated micro-batch counts")
    p.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = measure(args.device, args.layers, [int(a) for a in args.accum.split(",")], args.recipe, args.steps,
                     args.warmup, args.seq_len)
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
