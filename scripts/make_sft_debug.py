"""Write what configs/sft_debug.toml fine-tunes, with nothing downloaded:

    python scripts/make_sft_debug.py            # from the repository root
    meshtrain train --config sft_debug --nproc-per-node 4

- outputs/sft_debug_data/base/: a "pretrained" model folder as transformers saves one
  (config.json + model.safetensors): Qwen2ForCausalLM from configs/hf/qwen2-tiny/config.json,
  randomly initialized from a seed -- a stand-in for the Hugging Face model you would start from.
- outputs/sft_debug_data/records.jsonl: 2,000 small instruction records, half prompt/response,
  half chat "messages": reverse a word, add two numbers, name a colour's opposite.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["mesh", "shard", "tensor", "pipeline", "stage", "rank", "token", "batch", "layer", "model"]
OPPOSITES = {"black": "white", "white": "black", "hot": "cold", "cold": "hot", "up": "down", "down": "up"}


def record(rng: random.Random) -> dict:
    task = rng.randrange(3)
    if task == 0:
        word = rng.choice(WORDS)
        prompt, answer = f"Reverse the word '{word}'.", word[::-1]
    elif task == 1:
        a, b = rng.randrange(100), rng.randrange(100)
        prompt, answer = f"What is {a} + {b}?", str(a + b)
    else:
        word = rng.choice(list(OPPOSITES))
        prompt, answer = f"What is the opposite of '{word}'?", OPPOSITES[word]
    if rng.random() < 0.5:
        return {"prompt": f"Question: {prompt}\nAnswer:", "response": f" {answer}\n"}
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/sft_debug_data")
    p.add_argument("--records", type=int, default=2000)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs" / "hf" / "qwen2-tiny"))
    base.save_pretrained(out / "base")
    rng = random.Random(0)
    with open(out / "records.jsonl", "w") as f:
        for _ in range(args.records):
            f.write(json.dumps(record(rng)) + "\n")
    print(f"wrote {out / 'base'} and {out / 'records.jsonl'} ({args.records} records)")


if __name__ == "__main__":
    main()
