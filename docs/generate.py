"""Write the docs that are read off the code, so that they cannot drift from it.

    python -m docs.generate            # rewrite docs/mesh.md and docs/config.md
    python -m docs.generate --check    # exit 1 naming the files that differ (tests/test_docs.py)

mesh.md: the rank groups of a few layouts on 2 nodes x 8 GPUs, read off the DeviceMesh that
`ParallelDims.build_mesh` builds on each of the 16 ranks. A fake process group stands in for
the cluster, so it runs in one process, in seconds, with no communication.
config.md: every section and key of `training.config.JobConfig`, from the dataclass fields
and their `opt(...)` metadata (the same data `train.py --help` and the validator use).
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

DOCS = Path(__file__).resolve().parent
NODES, GPUS_PER_NODE = 2, 8
WORLD = NODES * GPUS_PER_NODE

# The layouts to draw and a word on when each is used; the groups come from build_mesh.
LAYOUTS = [
    ("FSDP 16", dict(dp_shard=16),
     "Plain FSDP over all 16 GPUs: one shard group that spans both nodes, so every "
     "all-gather and reduce-scatter goes over the inter-node network, and there are no "
     "per-layer TP collectives at all."),
    ("TP 8 in a node x FSDP 2 across", dict(dp_shard=2, tp=8),
     "The shape of `configs/llama70b_2d.toml`: each node is one TP group, whose several "
     "collectives per layer stay on NVLink; FSDP pairs rank r with rank r + 8, so only "
     "FSDP's all-gathers and reduce-scatters, a few per block per step, leave the node."),
    ("HSDP: dp_replicate 2 x dp_shard 2 x tp 4", dict(dp_replicate=2, dp_shard=2, tp=4),
     "Hybrid sharding: parameters are sharded over dp_shard, inside a node here, and "
     "replicated over dp_replicate, across nodes, so the all-gathers never leave the node; "
     "only the gradient all-reduce between replicas does. Data loading shards the batch over "
     "the flattened `dp` = dp_replicate x dp_shard."),
    ("PP 2 x FSDP 2 x TP 4", dict(pp=2, dp_shard=2, tp=4),
     "pp is outermost: each pipeline stage owns a whole node, and the only traffic between "
     "the nodes is the activations at the stage boundary, point to point."),
]
TAGS = {"pp": "p", "dp_replicate": "r", "dp_shard": "s", "dp": "d", "tp": "t"}
CELL = 4  # characters per GPU in the pictures


# ---------------------------------------------------------------- mesh.md

def read_groups(degrees: dict[str, int]) -> tuple[dict[str, list[tuple[int, ...]]], str]:
    """Per mesh dimension (and the flattened "dp" when both dp dimensions exist), every
    group of ranks, as the 16 ranks' own DeviceMeshes report them; and the strategy
    `sharding_strategy = "auto"` resolves to on this mesh."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.parallel.fsdp import resolve_strategy
    from meshtrain.parallel import ParallelDims, submesh

    found: dict[str, set[tuple[int, ...]]] = {}
    for rank in range(WORLD):
        if dist.is_initialized():  # a fresh world for each rank's view
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
        try:
            mesh = ParallelDims(**degrees, world_size=WORLD).build_mesh("cpu")
            names = mesh.mesh_dim_names
            if "dp_replicate" in names and "dp_shard" in names:
                names += ("dp",)
            for name in names:
                group = tuple(submesh(mesh, name).mesh.tolist())
                assert rank in group, (name, rank, group)
                found.setdefault(name, set()).add(group)
            strategy = resolve_strategy("auto", mesh)
        finally:
            dist.destroy_process_group()
    return {name: sorted(groups) for name, groups in found.items()}, strategy


@functools.cache
def mesh_groups() -> dict[str, tuple[dict[str, list[tuple[int, ...]]], str]]:
    """title -> (groups, auto strategy) for each of LAYOUTS; built once per process."""
    return {title: read_groups(degrees) for title, degrees, _ in LAYOUTS}


def crosses_nodes(group) -> bool:
    return len({rank // GPUS_PER_NODE for rank in group}) > 1


def picture(groups: dict[str, list[tuple[int, ...]]]) -> list[str]:
    """The two nodes as boxes of 8 GPUs; one row per mesh dimension, where the GPUs that
    share a tag (t0, s1, ...) form one group. Then the groups themselves."""
    width = max(len(name) for name in groups) + 2
    inner = CELL * GPUS_PER_NODE + 1

    def row(label, cells):
        boxes = ["│" + "".join(c.rjust(CELL) for c in cells[n * GPUS_PER_NODE:(n + 1) * GPUS_PER_NODE])
                 + " │" for n in range(NODES)]
        return (label.ljust(width) + "   ".join(boxes)).rstrip()

    lines = [(" " * width + "   ".join(f"node {n}".center(inner + 2) for n in range(NODES))).rstrip(),
             " " * width + "   ".join("┌" + "─" * inner + "┐" for _ in range(NODES)),
             row("rank", [str(r) for r in range(WORLD)])]
    for name, gs in groups.items():
        tag = {rank: f"{TAGS[name]}{i}" for i, g in enumerate(gs) for rank in g}
        lines.append(row(name, [tag[r] for r in range(WORLD)]))
    lines += [" " * width + "   ".join("└" + "─" * inner + "┘" for _ in range(NODES)), ""]
    for name, gs in groups.items():
        listed = " ".join("[" + " ".join(map(str, g)) + "]" + "*" * crosses_nodes(g) for g in gs)
        count = f"{len(gs)} group{'s' * (len(gs) > 1)} of {len(gs[0])}:"
        lines.append(f"{name.ljust(width)}{count:<16}{listed}")
    if any(crosses_nodes(g) for gs in groups.values() for g in gs):
        lines.append(f"{'':{width}}{'':<16}* crosses the node boundary")
    return lines


def mesh_md() -> str:
    out = [
        "# The mesh on 2 nodes × 8 GPUs",
        "",
        "<!-- Generated by `python -m docs.generate` from parallel/layout.py (build_mesh) and parallel/mesh.py; do not edit. -->",
        "",
        "Which ranks talk to which, for four layouts of 16 GPUs. Nothing here is worked out",
        "by hand: for each of the 16 ranks, `ParallelDims(...).build_mesh()` builds that rank's",
        "`DeviceMesh` on a fake process group, and each group below is what",
        "`submesh(mesh, dim).mesh` reports. `tests/test_docs.py` fails when this page differs",
        "from what the code builds.",
        "",
        "How to read the pictures: torchrun numbers ranks node by node (rank = node × 8 + local",
        "rank). The mesh dimensions are `pp × dp_replicate × dp_shard × tp`, outermost first, and",
        "the last varies fastest, so a TP group is `tp` consecutive ranks. Dimensions of degree 1",
        "are left out of the mesh. Each row is one mesh dimension; the GPUs with the same tag",
        "(`t0`, `s1`, ...) form one group of it, listed again under the boxes, where `*` marks",
        "a group that crosses the node boundary (the slower inter-node network). Which",
        "dimension to put where, with estimates: [choosing_a_layout.md](choosing_a_layout.md).",
    ]
    for title, degrees, why in LAYOUTS:
        groups, strategy = mesh_groups()[title]
        args = ", ".join(f"{k}={v}" for k, v in degrees.items())
        text = (f"`ParallelDims({args})`, mesh dimensions "
                f"{', '.join(f'`{n}`' for n in groups if n != 'dp')}. {why} "
                f'`sharding_strategy = "auto"` resolves to `{strategy}` on this mesh.')
        out += ["", f"## {title}", "", textwrap.fill(text, 90, break_on_hyphens=False), "",
                "```text", *picture(groups), "```"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- config.md

def type_name(t) -> str:
    """int, str, list[int]...; a string already under `from __future__ import annotations`."""
    return t if isinstance(t, str) else t.__name__ if type(t) is type else str(t)


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def section_doc(cls) -> str:
    """A section's own docstring; dataclass makes one up from the signature when there is none."""
    doc = (cls.__doc__ or "").strip()
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def config_md() -> str:
    from meshtrain.training.config import SECTIONS, choices, default_of
    from meshtrain.training.config_values import describe_accepted, toml_value

    out = [
        "# Config reference",
        "",
        "<!-- Generated by `python -m docs.generate` from training/config.py; do not edit. -->",
        "",
        "Every key `train.py` accepts, read off the dataclasses of `training/config.py`, which",
        "also check every value and print `python train.py --help`. Values come from, lowest",
        "precedence first: the defaults below, a TOML file (`--config NAME` finds",
        "`configs/NAME.toml`; a file may `extends = \"other.toml\"`), and `--section.key value`",
        "or `--section.key=value` on the command line. `python train.py --config NAME",
        "--print-config` prints the merged result. \"Elsewhere\" lists names other trainers use",
        "for a key: they are not accepted, but the error message for one points here.",
        "",
        "Sections: " + " · ".join(f"[`[{name}]`](#{name})" for name in SECTIONS),
    ]
    for name, cls in SECTIONS.items():
        out += ["", f"## `[{name}]`", ""]
        if section_doc(cls):
            out += [section_doc(cls), ""]
        out += ["| key | type | default | accepted | meaning |", "|---|---|---|---|---|"]
        for f in fields(cls):
            meta = f.metadata
            if "choices" in meta:
                accepted = ", ".join(f"`{toml_value(c)}`" for c in choices(meta))
            elif f.type is bool:
                accepted = "`true`, `false`"
            else:
                accepted = describe_accepted(meta).replace("any value", "any")
                if getattr(f.type, "__origin__", None) is list and accepted != "any":
                    accepted = "each item " + accepted  # the bounds apply to every item
            meaning = meta.get("help", "")
            if meta.get("aliases"):
                meaning += "; elsewhere: " + ", ".join(f"`{a}`" for a in meta["aliases"])
            out.append(f"| `{f.name}` | {cell(type_name(f.type))} | `{cell(toml_value(default_of(f)))}` "
                       f"| {cell(accepted)} | {cell(meaning)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- command line

def render() -> dict[str, str]:
    """File name under docs/ -> its generated text."""
    return {"mesh.md": mesh_md(), "config.md": config_md()}


def stale(pages: dict[str, str], docs_dir: Path = DOCS) -> list[str]:
    """The pages whose file is missing or differs from the generated text."""
    def current(path):
        return path.read_text(encoding="utf-8") if path.exists() else None

    return [name for name, text in pages.items() if current(docs_dir / name) != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    pages = render()
    changed = stale(pages)
    if args.check:
        for name in changed:
            print(f"docs/{name} is out of date: run python -m docs.generate", file=sys.stderr)
        return 1 if changed else 0
    for name in changed:
        (DOCS / name).write_text(pages[name], encoding="utf-8", newline="\n")
        print(f"wrote docs/{name}")
    if not changed:
        print("up to date: " + ", ".join(f"docs/{name}" for name in pages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
