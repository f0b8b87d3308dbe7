"""The docs: generated pages up to date, the mesh picture true to build_mesh, every config
key documented, no broken relative link, and the TensorBoard plot script. One process."""

import importlib.util
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import fields

import pytest

from docs import generate
from meshtrain.parallel import ParallelDims, submesh
from tests.conftest import ROOT
from meshtrain.training.config import SECTIONS
from meshtrain.training.metrics import MetricsLogger

REGENERATE = "python -m docs.generate"


@pytest.fixture(scope="module")
def pages():
    return generate.render()


def test_generated_docs_are_up_to_date(pages):
    stale = generate.stale(pages)
    assert not stale, f"out of date: {', '.join('docs/' + n for n in stale)}; run `{REGENERATE}`"
    assert generate.main(["--check"]) == 0


def test_stale_names_missing_and_changed_files(pages, tmp_path):
    assert generate.stale(pages, tmp_path) == list(pages)
    for name, text in pages.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "config.md").write_text("edited by hand\n")
    assert generate.stale(pages, tmp_path) == ["config.md"]


def test_mesh_groups_partition_the_ranks_with_tp_inside_a_node():
    for title, degrees, _ in generate.LAYOUTS:
        groups, _ = generate.mesh_groups()[title]
        dims = ParallelDims(**degrees, world_size=generate.WORLD)
        for name, gs in groups.items():
            size = dims.dp if name == "dp" else dims.degrees[name]
            assert sorted(r for g in gs for r in g) == list(range(generate.WORLD)), (title, name)
            assert all(len(g) == size for g in gs), (title, name)
        for g in groups.get("tp", []):
            assert list(g) == list(range(g[0], g[0] + len(g))) and not generate.crosses_nodes(g)


def test_mesh_page_prose_matches_which_groups_cross_nodes():
    # The sentences written next to each picture in docs/generate.py rely on these.
    def crossing(title, name):
        return {generate.crosses_nodes(g) for g in generate.mesh_groups()[title][0][name]}

    titles = [t for t, _, _ in generate.LAYOUTS]
    fsdp, tp8, hsdp, pp = titles
    assert crossing(fsdp, "dp_shard") == {True}
    assert crossing(tp8, "tp") == {False} and crossing(tp8, "dp_shard") == {True}
    assert crossing(hsdp, "dp_shard") == {False} and crossing(hsdp, "dp_replicate") == {True}
    assert crossing(pp, "pp") == {True} and crossing(pp, "dp_shard") == {False}


@pytest.mark.parametrize("rank", [0, 6, 13])
def test_mesh_groups_are_each_ranks_own_submesh(fake_world, rank):
    for title, degrees, _ in generate.LAYOUTS:
        groups, _ = generate.mesh_groups()[title]
        fake_world(generate.WORLD, rank)
        mesh = ParallelDims(**degrees, world_size=generate.WORLD).build_mesh("cpu")
        for name, gs in groups.items():
            mine = [g for g in gs if rank in g]
            assert mine == [tuple(submesh(mesh, name).mesh.tolist())], (title, name)


def test_every_config_key_is_in_config_md():
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"^## `\[(\w+)\]`\n(.*?)(?=^## |\Z)", text, re.M | re.S)}
    missing = [f"[{section}] {f.name}" for section, cls in SECTIONS.items() for f in fields(cls)
               if f"| `{f.name}` |" not in blocks.get(section, "")]
    assert not missing, f"not in docs/config.md: {', '.join(missing)}; run `{REGENERATE}`"


def test_config_keys_named_in_the_docs_exist():
    # `[section] key ...` and --section.key in the hand-written pages (migration.md names
    # dozens): a renamed or removed key makes this fail instead of the docs going stale.
    keys = {section: {f.name for f in fields(cls)} for section, cls in SECTIONS.items()}
    unknown = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        named = re.findall(r"`\[(\w+)\] (\w+)", text) + re.findall(r"(?<![\w-])--(\w+)\.(\w+)", text)
        unknown += [f"{page.relative_to(ROOT)}: [{s}] {k}" for s, k in named
                    if s != "section" and k not in keys.get(s, ())]  # "--section.key" is the syntax
    assert not unknown, "no such config key: " + "; ".join(unknown)


def test_relative_links_point_to_existing_files():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks
        text = re.sub(r"`[^`\n]*`", "", text)                                             # inline code
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z]+:|#", target):  # a web address or an anchor on the same page
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files: " + "; ".join(broken)


def load_plot_script():
    spec = importlib.util.spec_from_file_location("plot_tensorboard", ROOT / "scripts" / "plot_tensorboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_tensorboard_draws_every_logged_point(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "run" / "tb", rank=0, log_freq=5, enable_tensorboard=True)
    for step in range(1, 21):
        if logger.should_log(step):  # steps 1, 5, 10, 15, 20
            logger.log(step, {"loss": 6.0 / step, "lr": 1e-3 * step / 20, "tokens_per_second": 400.0 + step,
                              "grad_norm": math.nan if step == 10 else 1.0})
    logger.close()
    plot = load_plot_script()
    out = tmp_path / "curves.svg"
    assert plot.main([str(tmp_path / "run" / "tb"), str(out)]) == 0

    svg = ET.parse(out).getroot()
    ns = {"svg": "http://www.w3.org/2000/svg"}
    panels = svg.findall("svg:g[@class='panel']", ns)
    assert [p.get("data-tag") for p in panels] == ["loss", "lr", "grad_norm", "tokens_per_second"]
    counts = {p.get("data-tag"): len(p.find("svg:polyline", ns).get("points").split()) for p in panels}
    assert counts == {"loss": 5, "lr": 5, "grad_norm": 4, "tokens_per_second": 5}  # the NaN is left out
    xs = [float(xy.split(",")[0]) for xy in panels[0].find("svg:polyline", ns).get("points").split()]
    assert xs == sorted(xs) and 0 < xs[0] < xs[-1] < float(svg.get("width"))
    assert "run" in svg.find("svg:text", ns).text  # the default title: the run's folder


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (1, 200), (2.13, 6.4), (1e-4, 1e-3), (5.0, 5.0), (-3.0, 0.5)])
def test_plot_ticks_cover_the_data(lo, hi):
    ticks = load_plot_script().nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 8


def test_commands_in_the_docs_exist():
    """Every `meshtrain COMMAND` and `python -m MODULE` the pages and the shipped configs
    tell a user to type names a real subcommand or module: one spelling, kept true."""
    from meshtrain.cli import COMMANDS

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.toml"))]
    wrong = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
        code = [line.strip() for block in blocks for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", text)
        if page.suffix == ".toml":  # the commands in a config's comments
            code = [line.lstrip("# ").split(": ", 1)[-1] for line in text.splitlines() if line.startswith("#")]
        for snippet in code:
            if re.match(r"meshtrain[\w ]*: ", snippet):  # a line meshtrain printed, not one to type
                continue
            for command in re.findall(r"(?:^|&& |srun )meshtrain ([a-z][\w-]*)", snippet):
                if command not in COMMANDS:
                    wrong.append(f"{page.name}: meshtrain {command}")
            for module in re.findall(r"python3? -m ([\w.]*\w)", snippet):
                if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                    wrong.append(f"{page.name}: python -m {module}")
    assert not wrong, "commands that do not exist:\n" + "\n".join(sorted(set(wrong)))
