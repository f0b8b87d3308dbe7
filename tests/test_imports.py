"""The package's modules import each other one way: no cycles, and each layer imports only
the layers below it. Read from the source with `ast`, so nothing is imported and the test
takes a second.

    physics      GPU tables, FLOPs per token          imports no other part of meshtrain
    models       model families                       -> nothing above it
    parallel     FSDP2 x TP x PP over one mesh        -> physics only; knows no model
    training     config, data, the step, checkpoints  -> models, parallel, physics
    planning     memory / time models, dry run, search -> anything below it

Every import counts, the ones inside functions too: a deferred import that closes a
circle is still a circle, only one that a reader cannot see at the top of the file.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "meshtrain"
SKIP = {"tests", "bench", "scripts", "examples", "docs", "configs", ".venv", "build"}

# layer -> the layers it may not import
FORBIDDEN = {
    "physics": {"models", "parallel", "training", "planning"},
    "models": {"training", "planning"},
    "parallel": {"models", "training", "planning"},
    "training": {"planning"},
}


def module_files() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (the repository root is
    `meshtrain`; a package's __init__.py is the package's own name)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or any(p.startswith(".") for p in rel.parts):
            continue
        parts = [PACKAGE, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def lazy_exports(modules: dict[str, Path], package: str) -> dict[str, str]:
    """Name -> submodule of a package whose __init__ hands its names out lazily: a
    module-level `_EXPORTS = {"submodule": ("name", ...), ...}` literal."""
    tree = ast.parse(modules[package].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            table = ast.literal_eval(node.value)
            return {name: f"{package}.{sub}" for sub, names in table.items() for name in names}
    return {}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file, with the packages
    whose __init__ runs on the way (except its own ancestors, which are already running)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    targets.append(full)  # a submodule
                elif node.module in modules:
                    targets.append(lazy_exports(modules, node.module).get(alias.name, node.module))
        for target in targets:
            if not target.startswith(PACKAGE + ".") and target != PACKAGE:
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # meshtrain.a, meshtrain.a.b, ...: each runs
                step = ".".join(parts[:i])
                if step in modules and step != name and not name.startswith(step + "."):
                    out.add(step)
    return out


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in edges.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_the_graph_sees_the_package():
    edges = graph()
    assert "meshtrain.train" in edges and "meshtrain.planning.plan" in edges
    assert "meshtrain.training.config" in edges["meshtrain.training.config_loader"]


def test_no_module_imports_itself_through_others():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = sorted(f"{module} imports {target}" for module, targets in graph().items() for target in targets
                   if layer(target) in FORBIDDEN.get(layer(module), ()))
    assert not wrong, "\n".join(wrong)
