"""The package layout holds (docs/architecture.md): imports point one way, no two modules import each
other, and only the family registry and the family folders know the family names.

Every import in the source counts, at module level or inside a function, since a lazy import is a
dependency all the same.
"""
from __future__ import annotations

import ast
from pathlib import Path

from models.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("parallel", "models", "bench")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts a.b.c when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                     for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_every_import_resolves_to_a_module():
    unknown = {f"{m} imports {i}" for m, imports in GRAPH.items() for i in imports if i not in MODULES}
    assert not unknown, sorted(unknown)


def test_primitives_import_only_primitives():
    """parallel/distributed/ imports no model family, no training loop, no planner, config or checker."""
    wrong = [f"{m} imports {i}" for m, imports in GRAPH.items() if _inside(m, "parallel.distributed")
             for i in imports if not _inside(i, "parallel.distributed")]
    assert not wrong, wrong


def test_models_import_only_models_and_primitives():
    wrong = [f"{m} imports {i}" for m, imports in GRAPH.items()
             if _inside(m, "models") and m != "models.__main__"          # the CLI sits on top of everything
             for i in imports if not (_inside(i, "models") or _inside(i, "parallel.distributed"))]
    assert not wrong, wrong


def test_no_import_cycles():
    """No module reaches itself through the import graph (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def _family_code(module: str) -> bool:
    return module == "models.registry" or any(_inside(module, f"models.{name}") for name in FAMILIES)


def test_family_names_only_in_the_registry_and_family_folders():
    """Nothing outside asks "which family is this?": no comparison with a family name or `.family`,
    no table indexed by `.family`."""
    names = set(FAMILIES)
    found = []
    for module, path in MODULES.items():
        if _family_code(module):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in names for o in operands) or \
                        any(isinstance(o, ast.Attribute) and o.attr == "family" for o in operands):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Attribute) \
                    and node.slice.attr == "family":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_the_checks_see_a_violation():
    """The walkers find what they look for (a check that cannot fail would prove nothing)."""
    assert "parallel.distributed.comm" in GRAPH["parallel.distributed.layers"]
    assert "models.registry" in GRAPH["parallel.config"]
    tree = ast.parse('if cfg.model.family == "stdit":\n    pass\n')
    compare = next(n for n in ast.walk(tree) if isinstance(n, ast.Compare))
    assert any(isinstance(o, ast.Attribute) and o.attr == "family" for o in [compare.left, *compare.comparators])
