"""The package layout holds (docs/architecture.md): the layers are folders (each folder directly under parallel/ in
one layer; parallel/'s own modules, at most 8, are the commands on top), every import points down the layers, no
two modules or packages import each other, no family folder imports another's (what two share lives in
models/shared/), only the family registry and the family folders know the family names, and only
parallel/distributed/deepspeed/ reads DeepSpeed's private attributes. The tests share helpers through
tests/helpers/, never by importing a test module, and bench/ imports no test.

Every import in the source counts, at module level or inside a function, since a lazy import is a
dependency all the same.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from models.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("parallel", "models", "bench")
ENTRY_SCRIPTS = {"train": ROOT / "train.py"}


# What the benchmarks write (bench/out/, git-ignored): scripts/gpu-check.sh --pack unpacks DeepSpeed, diffusers and
# peft there for a device machine; their sources are not the project's.
OUTPUT = ROOT / "bench" / "out"


def _sources(tree: str) -> list[Path]:
    return [p for p in sorted((ROOT / tree).rglob("*.py")) if not p.is_relative_to(OUTPUT)]


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in _sources(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {**out, **ENTRY_SCRIPTS}


MODULES = _modules()


def _import_lines(path: Path) -> list[tuple[str, int, str]]:
    return _imports_in(path.read_text())


def _imports_in(text: str) -> list[tuple[str, int, str]]:
    """(project module, line, the import statement) for each project module `text` imports, at module level or
    inside a function (`from a.b import c` counts a.b.c when that is a module)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                     for alias in node.names]
        else:
            continue
        found += [(n, node.lineno, ast.unparse(node)) for n in dict.fromkeys(names) if n.split(".")[0] in PACKAGES]
    return found


IMPORTS = {name: [i for i in _import_lines(path) if i[0] != name] for name, path in MODULES.items()}
GRAPH = {name: {i[0] for i in imports} for name, imports in IMPORTS.items()}

# The layers, lowest first, read from the tree: each lists folders (dotted), and a module is in the layer of the
# nearest folder listed above it. Every folder directly under parallel/ is listed (a room of its own, in one layer);
# a folder inside a listed one is in its layer (parallel/distributed/deepspeed/, models/wan/). The modules directly
# in parallel/ (listed as "parallel") are the commands, on top of everything the toolkit has: at most
# MAX_FLAT_MODULES of them, each a package of its own in the package graph. Only the entry points' layer names
# files: entry scripts and a package's `__main__`, which nothing imports. docs/architecture.md says why each folder
# sits where it does. A module may import its own layer's modules and any lower layer's, never a higher one's.
LAYERS = (
    ("primitives", ("parallel.distributed",)),
    ("models", ("models",)),
    ("experiment", ("parallel.experiment",)),
    ("model build", ("parallel.model",)),
    ("weights, data", ("parallel.weights", "parallel.prepare_data")),
    ("checkpoints, validation", ("parallel.checkpoints", "parallel.validation")),
    ("training", ("parallel.train",)),
    ("commands", ("parallel", "parallel.plan")),
    ("entry points", ("train", "bench", "models.__main__")),
)
LAYER_OF = {prefix: i for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes}
COMMANDS = "parallel"            # the root folder: its modules are the commands
ENTRY_POINTS = len(LAYERS) - 1
MAX_FLAT_MODULES = 8             # parallel/*.py, __init__.py counted


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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No module reaches itself through the import graph."""
    assert not _cycles(GRAPH), _cycles(GRAPH)


def _folder(module: str) -> str | None:
    """The LAYERS entry `module` belongs to: the longest that holds it."""
    holding = [p for p in LAYER_OF if _inside(module, p)]
    return max(holding, key=len) if holding else None


def _package(module: str) -> str | None:
    """The node of the package graph `module` is in: its folder, or itself for a command (a module of parallel/)."""
    folder = _folder(module)
    return module if folder == COMMANDS else folder


def test_every_module_has_a_layer():
    unlisted = [m for m in MODULES if _folder(m) is None]
    assert not unlisted, f"add these modules' folders to LAYERS (and docs/architecture.md): {unlisted}"


def _upward(imports: dict[str, list[tuple[str, int, str]]]) -> list[str]:
    """'file:line: import ... (module, layer, imports a higher layer's module)' for each upward import."""
    wrong = []
    for module, found in imports.items():
        here = LAYER_OF[_folder(module)]
        for target, line, statement in found:
            there = LAYER_OF[_folder(target)]
            if there > here:
                path = MODULES[module].relative_to(ROOT) if module in MODULES else module
                wrong.append(f"{path}:{line}: {statement}  ({module}, layer '{LAYERS[here][0]}', imports "
                             f"{target}, layer '{LAYERS[there][0]}')")
    return wrong


def test_imports_point_down_the_layers():
    wrong = _upward(IMPORTS)
    assert not wrong, "imports of a higher layer (move the code down, or the import up):\n" + "\n".join(wrong)


def _package_graph() -> dict[str, set[str]]:
    packages = {}
    for module, imports in GRAPH.items():
        here = _package(module)
        packages.setdefault(here, set()).update(_package(i) for i in imports if _package(i) != here)
    return packages


def test_no_package_cycles():
    """No two packages of LAYERS import each other, directly or through others (same-layer ones included),
    function-level imports counted: GRAPH has every import of the source, lazy ones too."""
    cycles = _cycles(_package_graph())
    assert not cycles, f"packages that import each other: {cycles}"


def _split_folders(entries) -> list[str]:
    """The LAYERS entries that are not a folder of their own: a module (only the entry points' layer names files),
    a folder that does not exist, or a folder inside another listed one (half of a folder listed apart from the
    rest would hide its cycles from the package graph); the root `parallel` holds the listed rooms."""
    wrong = []
    for entry in entries:
        parts = entry.split(".")
        if (ROOT.joinpath(*parts) / "__init__.py").is_file():
            outer = [o for o in entries if o not in (entry, COMMANDS) and _inside(entry, o)]
            wrong += [f"{entry} (inside {o}/, listed apart: list the folder once)" for o in outer]
        elif LAYER_OF.get(entry) != ENTRY_POINTS:
            wrong.append(f"{entry} (not a folder: list the folder that holds it)")
    return wrong


def test_layers_are_folders():
    """A folder is one package, in one layer: listing half of one elsewhere would hide a cycle through it (the
    planner's search and command were once listed as commands while its memory model sat below training)."""
    entries = [e for _, listed in LAYERS for e in listed]
    assert len(entries) == len(set(entries)), "a folder listed in two layers"
    wrong = _split_folders(entries)
    assert not wrong, wrong


def _rooms(root: Path) -> list[str]:
    """The folders directly under `root` (dotted), each a package (__init__.py)."""
    return sorted(".".join(p.relative_to(ROOT).parts) for p in root.iterdir() if (p / "__init__.py").is_file())


def _unlisted(rooms, listed) -> list[str]:
    return [f"{room.replace('.', '/')}/ (give it a layer in LAYERS and docs/architecture.md)"
            for room in rooms if room not in listed]


def test_every_folder_of_parallel_is_a_layer():
    """Each folder directly under parallel/ is listed in LAYERS: a new one says which layer it is, rather than
    falling into the commands' with the modules beside it."""
    wrong = _unlisted(_rooms(ROOT / "parallel"), LAYER_OF)
    assert not wrong, wrong


def _flat_modules() -> list[str]:
    return sorted(p.name for p in (ROOT / COMMANDS).glob("*.py"))


def test_at_most_8_modules_flat_in_parallel():
    """parallel/'s own modules are the commands (each `python -m parallel.<name>`) and __init__.py; a helper
    goes in the folder of its layer."""
    flat = _flat_modules()
    assert len(flat) <= MAX_FLAT_MODULES, (f"{len(flat)} modules flat in parallel/ (at most {MAX_FLAT_MODULES}): "
                                           f"{flat}; move helpers into their layer's folder")


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


# The family folders: every package under models/ but the shared one (models/shared/: what two families build
# from), read from the tree, not listed by hand.
SHARED = "models.shared"
FAMILY_FOLDERS = tuple(sorted(f"models.{p.name}" for p in (ROOT / "models").iterdir()
                              if (p / "__init__.py").is_file() and f"models.{p.name}" != SHARED))


def _family_of(module: str) -> str | None:
    return next((folder for folder in FAMILY_FOLDERS if _inside(module, folder)), None)


def _sideways(imports: dict[str, list[tuple[str, int, str]]]) -> list[str]:
    """'file:line: import ...  (module imports another family's folder)' for each import of a family folder from
    outside it by a module of another family folder or of the shared package."""
    wrong = []
    for module, found in imports.items():
        here = _family_of(module)
        if here is None and not _inside(module, SHARED):
            continue
        for target, line, statement in found:
            there = _family_of(target)
            if there is not None and there != here:
                path = MODULES[module].relative_to(ROOT) if module in MODULES else module
                wrong.append(f"{path}:{line}: {statement}  ({module} imports {there}/)")
    return wrong


def test_no_family_imports_another_family_s_folder():
    """A family folder imports its own modules, models/shared/ and models/' top-level modules (and lower layers),
    never another family's folder; models/shared/ imports no family folder. Function-level imports counted."""
    assert {"models.cogvideox", "models.hunyuanvideo", "models.hunyuanvideo15", "models.stdit"} <= set(FAMILY_FOLDERS)
    assert SHARED not in FAMILY_FOLDERS
    wrong = _sideways(IMPORTS)
    assert not wrong, ("a family reaching into another's folder (move what they share into models/shared/):\n"
                       + "\n".join(wrong))


def test_the_checks_see_a_violation():
    """The walkers find what they look for (a check that cannot fail would prove nothing)."""
    assert "parallel.distributed.comm" in GRAPH["parallel.distributed.layers"]
    assert "models.registry" in GRAPH["models.vae"]          # imported inside check_vae: a lazy import counts
    upward = _upward({"parallel.distributed.topology": [("parallel.check", 7, "from parallel.check import check")]})
    assert upward == ["parallel/distributed/topology.py:7: from parallel.check import check  (parallel.distributed."
                      "topology, layer 'primitives', imports parallel.check, layer 'commands')"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _split_folders(["parallel.plan.search", "parallel.plan", "parallel.check", "models.__main__", "parallel",
                           "parallel.distributed", "parallel.distributed.deepspeed"]) == \
        ["parallel.plan.search (not a folder: list the folder that holds it)",
         "parallel.check (not a folder: list the folder that holds it)",
         "parallel.distributed.deepspeed (inside parallel.distributed/, listed apart: list the folder once)"]
    assert _unlisted(["parallel.plan", "parallel.new"], LAYER_OF) == \
        ["parallel/new/ (give it a layer in LAYERS and docs/architecture.md)"]
    assert "check.py" in _flat_modules() and "__init__.py" in _flat_modules()
    assert _package("parallel.check") == "parallel.check" and _package("parallel.plan.search") == "parallel.plan"
    assert _test_module_imports("from tests.unit.test_wan import released\nfrom tests.unit import test_plan as p\n"
                                "def f():\n    from .test_x import y\n    from tests.helpers.wan import inputs\n",
                                "t.py") == ["t.py:1: tests.unit.test_wan", "t.py:1: tests.unit.test_wan.released",
                                            "t.py:2: tests.unit.test_plan", "t.py:4: .test_x", "t.py:4: .test_x.y"]
    assert _imports_of_tests("def measure():\n    from tests.dist_utils import run_ranks\n", "b.py") == \
        ["b.py:2: tests.dist_utils", "b.py:2: tests.dist_utils.run_ranks"]
    # a function-level import is an edge of the package graph: the old cycle through the checker
    lazy = _imports_in("def plan():\n    from parallel.plan.memory import plan_memory\n")
    assert lazy == [("parallel.plan.memory", 2, "from parallel.plan.memory import plan_memory")]
    graph = {"parallel.train.run": {lazy[0][0]}, "parallel.plan.search": {"parallel.check"},
             "parallel.check": {"parallel.train.schedule"}}
    packages = {_package(m) for m in graph} | {_package(i) for m in graph for i in graph[m]}
    assert packages == {"parallel.train", "parallel.plan", "parallel.check"}
    assert _cycles({p: {_package(i) for m, found in graph.items() if _package(m) == p for i in found} - {p}
                    for p in packages}) == [["parallel.check", "parallel.plan", "parallel.train"]]
    assert _private_reads("engine._global_grad_norm = 1\nif hasattr(p, 'ds_id'):\n    x = m.module._x\n"
                          "def _partition_layers(self, method):\n    pass\n", "f.py") == \
        ["f.py:1: ._global_grad_norm", "f.py:2: 'ds_id'", "f.py:3: ._x", "f.py:4: def _partition_layers"]
    # a family's module (a lazy import too) reaching into another family's folder, and the shared package into one
    sideways = {"models.stdit.model": _imports_in("def f():\n    from models.cogvideox.pipeline import T5\n"),
                "models.shared.mmdit": _imports_in("from models.hunyuanvideo.config import HunyuanVideoConfig\n"),
                "models.hunyuanvideo15.embed": _imports_in("from models.shared.refiner import MLP\n"
                                                           "from models.hunyuanvideo15.config import C\n"
                                                           "from models.geometry import patchify\n"),
                "models.registry": _imports_in("from models import stdit\n")}
    assert _sideways(sideways) == [
        "models/stdit/model.py:2: from models.cogvideox.pipeline import T5  (models.stdit.model imports "
        "models.cogvideox/)",
        "models/shared/mmdit.py:1: from models.hunyuanvideo.config import HunyuanVideoConfig  (models.shared.mmdit "
        "imports models.hunyuanvideo/)"]
    assert "models.registry" in GRAPH["parallel.experiment.config"]
    tree = ast.parse('if cfg.model.family == "stdit":\n    pass\n')
    compare = next(n for n in ast.walk(tree) if isinstance(n, ast.Compare))
    assert any(isinstance(o, ast.Attribute) and o.attr == "family" for o in [compare.left, *compare.comparators])


# DeepSpeed's private names: ZeRO-3's parameter attributes, the optimizer wrappers', the engine's and the
# pipeline module's (attributes, getattr/hasattr strings, or overridden hooks).
DEEPSPEED_PRIVATE = {"ds_id", "ds_tensor", "ds_shape", "ds_numel", "ds_status", "ds_persist", "ds_process_group",
                     "ds_secondary_tensor", "ds_active_sub_modules", "ds_external_parameters",
                     "_hp_mapping", "_hp_optimizer_states_linked", "_lazy_init_hp_params_optimizer_state",
                     "_global_grad_norm", "_config", "_topo", "_set_bounds", "_partition_layers", "_build",
                     "_local_start", "_local_stop", "_take_model_step", "_do_optimizer_sanity_check",
                     "_configure_checkpointing", "_configure_optimizer", "_release_sub_group",
                     "forward_funcs", "basic_optimizer", "checkpoint_engine", "ipg_buckets", "deepspeed_saved_tensors"}
DEEPSPEED_PREFIXES = ("_z3_", "_hp_", "_ds_")
# Underscored names of torch and the standard library the source reads (not DeepSpeed's): storage identity,
# a view's base, foreach kernels, the CPU flash-attention op the tracer calls, the watchdog's hard exit, and the
# attention ops that return the log-sum-exp ring attention merges by (parallel/distributed/ring.py).
# _apply: torch's nn.Module._apply, which .to() and the casts call; block swap's stage modules override it to keep their
# swapped weights in host memory (parallel/distributed/pipeline.py HostResident).
# _resolve_process_group: a process group from its name, as torch's functional collectives find theirs; the toolkit's
# all-reduce operator is given the name, as an operator's arguments cannot hold a group (parallel/distributed/comm.py).
OTHER_PRIVATE = {"_cdata", "_base", "_foreach_mul_", "_foreach_add_", "_scaled_dot_product_flash_attention_for_cpu",
                 "_exit", "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_backward", "_apply", "_resolve_process_group",
                 "_schema"}      # an aten op's schema: which arguments it writes (bench/step_bytes.py counts bytes)


def _private_reads(text: str, where: str) -> list[str]:
    """'where:line: name' for each DeepSpeed private name in `text`: an attribute (or any underscored
    attribute of an object other than self/cls, not in OTHER_PRIVATE), a string naming one
    (getattr/hasattr), or a method overriding one of DeepSpeed's hooks."""
    def private(name: str) -> bool:
        return name in DEEPSPEED_PRIVATE or name.startswith(DEEPSPEED_PREFIXES)
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            underscored = re.match(r"_[^_]", node.attr) and node.attr not in OTHER_PRIVATE
            if private(node.attr) or (underscored and not own):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and private(node.value):
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
            found.append((node.lineno, f"def {node.name}"))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def test_deepspeed_private_names_only_in_their_package():
    """parallel/distributed/deepspeed/ holds every read of DeepSpeed's internals, each behind a named helper
    with its version note and its test (tests/unit/test_deepspeed_compat.py)."""
    found = [hit for module, path in MODULES.items() if not _inside(module, "parallel.distributed.deepspeed")
             for hit in _private_reads(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("DeepSpeed internals read outside parallel/distributed/deepspeed/ (add a named helper "
                       "there, with its version note and a test in tests/unit/test_deepspeed_compat.py; "
                       "a torch private name goes in OTHER_PRIVATE, with why):\n" + "\n".join(found))


def _imported_names(text: str) -> list[tuple[str, int]]:
    """(dotted module or module.name, line) for every import in `text`, at module level or inside a function;
    a relative import gets its dots."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found += [(module, node.lineno)] + [(f"{module}.{alias.name}".replace("..", "."), node.lineno)
                                                for alias in node.names]
    return found


def _test_module_imports(text: str, where: str) -> list[str]:
    """'where:line: name' for each import of a project `test_*` module (collected by pytest, never imported)."""
    return sorted({f"{where}:{line}: {name}" for name, line in _imported_names(text)
                   if (name.split(".")[0] in (*PACKAGES, "tests") or name.startswith("."))
                   and any(part.startswith("test_") for part in name.split("."))})


SOURCE_TREES = (*PACKAGES, "tests")


def _python_files():
    yield from (p for tree in SOURCE_TREES for p in _sources(tree))
    yield from ENTRY_SCRIPTS.values()


def test_no_test_module_is_imported():
    """Tests share helpers and fixtures through tests/helpers/ (and the tests/*_utils.py modules), never by importing
    another test module: a `test_*` module is pytest's to collect, and what it holds is its own tests."""
    found = [hit for path in _python_files()
             for hit in _test_module_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("test modules imported (move what they share into tests/helpers/):\n" + "\n".join(found))


def _imports_of_tests(text: str, where: str) -> list[str]:
    return sorted({f"{where}:{line}: {name}" for name, line in _imported_names(text) if name.split(".")[0] == "tests"})


def test_bench_imports_nothing_from_tests():
    """bench/ stands alone (python -m bench runs from a checkout without tests/): what it shares with the tests
    lives in bench/ (bench/ranks.py's run_ranks) or in the toolkit."""
    found = [hit for path in _sources("bench")
             for hit in _imports_of_tests(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "bench/ imports tests/:\n" + "\n".join(found)


def render_package_graph() -> str:
    """The layers, highest first, each package with the packages it imports (docs/architecture.md shows it):
    python -m tests.unit.test_architecture"""
    graph, out = _package_graph(), []
    for i in reversed(range(len(LAYERS))):
        name, folders = LAYERS[i]
        out.append(f"{i} {name}")
        for folder in folders:
            # the commands' folder: one line per module (each a package); every other folder: one line
            packages = sorted(p for p in graph if _folder(p) == COMMANDS) if folder == COMMANDS else [folder]
            for package in (p for p in packages if p in graph):
                below = sorted(graph[package], key=lambda p: (-LAYER_OF[_folder(p)], p))
                out.append(f"    {package:<24} -> {', '.join(below) or '(nothing of the project)'}")
    return "\n".join(out)


def test_the_documented_package_graph_is_the_code_s():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    shown = doc[doc.index("```text\n") + len("```text\n"):]
    shown = shown[:shown.index("```")].strip()
    assert shown == render_package_graph(), ("docs/architecture.md's package graph is not the code's: paste what "
                                             "`python -m tests.unit.test_architecture` prints")


if __name__ == "__main__":
    print(render_package_graph())
