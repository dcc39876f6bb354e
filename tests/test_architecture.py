"""The package map holds: one package per concern, imports only downwards, no import cycle.

The import graph of src/zeroshard is built from the source (ast), so a module that would not
even import is still checked: absolute and relative imports, ``from package import module``
as an import of that module, and imports inside functions or under ``if TYPE_CHECKING:``
alike (a type-only import is a dependency too). ``LAYERS`` and ``SUBLAYERS`` are written once
here and once in docs/DESIGN.md, whose map a test holds to the tree.

The rule: a module imports modules of its own top-level package and of the layers below its
own; the packages of one layer import not each other. Inside a package that has sub-packages,
a sub-package imports only the sub-packages below it in ``SUBLAYERS``; the modules directly in
the package are its hub and may import any of them. Strings that name modules
(``zeroshard.CHECKPOINT_FORMATS``, the lazy exports of a package) are not imports; their own
tests below check what they name.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
PACKAGE = SOURCE / "zeroshard"
DESIGN = ROOT / "docs" / "DESIGN.md"

# Lowest first. "__init__" is the package face (zeroshard/__init__.py: __version__, the
# formats table, lazy exports), which the layers above it import for the version and the table.
LAYERS = (
    ("lazy_exports",),
    ("__init__",),
    ("layout", "collector", "comm", "launch"),
    ("io", "state", "buffers", "models"),
    ("engine", "moe", "torchfile"),
    ("checkpoint",),
    ("deepspeed",),
    ("integrations",),
    ("demos",),
    ("cli",),
    ("__main__",),
)
# The order of the sub-packages of each package that has any, lowest first.
SUBLAYERS = {
    "checkpoint": (("attest",), ("native", "universal"), ("export",)),
    "deepspeed": (("checkpoint",),),
}
# Placed in the order before their code lands: the trainer integrations (transformers,
# accelerate, lightning) come in their own change.
NOT_YET = {"integrations"}
# The checkpoint layer's place: every registered format is read by a module at or above it.
CHECKPOINT_LAYER = "checkpoint"


@dataclass
class Module:
    name: str  # dotted: zeroshard.checkpoint.loader
    path: Path
    is_package: bool
    imports: dict[str, int] = field(default_factory=dict)  # imported module -> first line
    missing: list[str] = field(default_factory=list)  # "line: what" of imports naming no module

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def modules() -> dict[str, Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        found[name] = Module(name, path, is_package)
    return found


def import_graph() -> dict[str, Module]:
    """Every module of src/zeroshard with the zeroshard modules it imports."""
    graph = modules()
    for module in graph.values():
        for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))):
            for target in _targets(node, module):
                if target in graph:
                    if target != module.name:
                        module.imports.setdefault(target, node.lineno)
                else:
                    module.missing.append(f"line {node.lineno}: {target}")
    return graph


def _targets(node: ast.AST, module: Module) -> list[str]:
    """The zeroshard modules an import statement imports (``from p import m``: p.m when m is a
    module, else p)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "zeroshard"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.package.split(".")
        base = base[: len(base) - node.level + 1]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    if target.split(".")[0] != "zeroshard":
        return []
    names = [f"{target}.{alias.name}" for alias in node.names]
    submodules = [name for name in names if (_module_file(name) is not None)]
    return submodules + ([target] if len(submodules) < len(names) else [])


def _module_file(name: str) -> Path | None:
    relative = Path(*name.split("."))
    for path in (SOURCE / relative.with_suffix(".py"), SOURCE / relative / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level(name: str) -> str:
    """``layout`` for zeroshard.layout.group; ``__init__`` for the package face."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(name: str) -> int | None:
    """The index in LAYERS of the module's top-level package; None when it has no place (the
    test of the order's coverage names it)."""
    return next((index for index, layer in enumerate(LAYERS) if top_level(name) in layer), None)


def describe(name: str) -> str:
    layer = layer_of(name)
    return f"{name} (not in LAYERS)" if layer is None else f"{name} (layer {layer}: {', '.join(LAYERS[layer])})"


def cycles(graph: dict[str, Module]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start].imports)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target].imports))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(set(component))
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, Module], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth first)."""
    start = min(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node].imports):
                if target == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if target in component and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def upward_imports(graph: dict[str, Module]) -> list[str]:
    """Every import that goes up (or sideways) in LAYERS or SUBLAYERS, named."""
    wrong = []
    for module in graph.values():
        for target, line in sorted(module.imports.items()):
            if layer_of(module.name) is None or layer_of(target) is None:
                problem = None  # unplaced: the test of the order's coverage names it
            elif top_level(module.name) == top_level(target):
                problem = _sublayer_problem(module.name, target)
            elif layer_of(target) >= layer_of(module.name):
                problem = f"{describe(module.name)} imports {describe(target)}"
            else:
                problem = None
            if problem:
                wrong.append(f"{module.path.relative_to(ROOT)}:{line}: {problem}")
    return wrong


def _sub_package(name: str) -> str | None:
    """``attest`` for zeroshard.checkpoint.attest.digests; None for a hub module of its package."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    candidate = PACKAGE / parts[1] / parts[2]
    return parts[2] if (candidate / "__init__.py").is_file() else None


def _sublayer_problem(module: str, target: str) -> str | None:
    order = SUBLAYERS.get(top_level(module))
    mine, theirs = _sub_package(module), _sub_package(target)
    if order is None or mine is None or theirs is None or mine == theirs:
        return None
    rank = {name: index for index, layer in enumerate(order) for name in layer}
    if mine not in rank or theirs not in rank or rank[theirs] < rank[mine]:
        return None  # unplaced sub-packages are named by the coverage test
    package = top_level(module)
    return f"{module} ({package}/{mine}) imports {target} ({package}/{theirs}), not below it in {order}"


def tree_packages() -> set[str]:
    """Every package under src/zeroshard, as ``checkpoint/attest/``."""
    packages = {path.parent for path in PACKAGE.rglob("__init__.py")} - {PACKAGE}
    return {f"{package.relative_to(PACKAGE).as_posix()}/" for package in packages}


def top_level_modules() -> set[str]:
    return {path.name for path in PACKAGE.glob("*.py")}


# ---- the graph ----------------------------------------------------------------------------


def test_the_graph_sees_relative_absolute_submodule_and_type_only_imports():
    graph = import_graph()
    assert "zeroshard.io.safetensors_io" in graph["zeroshard.checkpoint.native.save"].imports  # from ...io.x import y
    assert "zeroshard.io.jsonvalue" in graph["zeroshard.moe.pretrained"].imports  # from ..io import jsonvalue
    assert "zeroshard.engine.parts" in graph["zeroshard.engine.fragments"].imports  # under TYPE_CHECKING
    assert "zeroshard" in graph["zeroshard.cli.main"].imports  # from .. import __version__
    assert "zeroshard.launch" in graph["zeroshard.cli.demo_cmd"].imports  # inside a function
    assert "zeroshard.checkpoint.export.fp32" in graph["zeroshard.cli.convert_cmd"].imports  # from ..a.b import name


def test_every_import_names_a_module_that_exists():
    """A module path left behind by a move (or a merge from before one) names no module."""
    graph = import_graph()
    missing = [f"{module.path.relative_to(ROOT)}: {what}" for module in graph.values() for what in module.missing]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_cycle_finder_finds_a_cycle_and_names_it():
    """A test that cannot fail proves nothing: the finder, on a graph with a cycle."""
    graph = {name: Module(name, PACKAGE, False) for name in ("a", "b", "c", "d")}
    graph["a"].imports = {"b": 1}
    graph["b"].imports = {"c": 1, "d": 1}
    graph["c"].imports = {"a": 1}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    del graph["c"].imports["a"]
    assert cycles(graph) == []


def test_imports_go_only_downwards():
    wrong = upward_imports(import_graph())
    assert not wrong, "imports against the layer order (LAYERS, docs/DESIGN.md):\n" + "\n".join(wrong)


def test_an_upward_import_is_named_with_both_modules():
    graph = import_graph()
    graph["zeroshard.layout.group"].imports["zeroshard.checkpoint.loader"] = 7
    graph["zeroshard.checkpoint.native.save"].imports["zeroshard.checkpoint.universal.write"] = 9
    wrong = upward_imports(graph)
    upward = "zeroshard.layout.group (layer 2: layout, collector, comm, launch) imports zeroshard.checkpoint.loader"
    assert any(upward in line for line in wrong)
    assert any("native/save.py:9:" in line and "(checkpoint/universal)" in line for line in wrong)


# ---- the order covers the tree ------------------------------------------------------------


def test_every_package_and_top_level_module_has_its_place_in_the_order():
    """A new package (or loose module) must be placed before it can land."""
    placed = {name for layer in LAYERS for name in layer}
    present = {name.removesuffix(".py") for name in top_level_modules()} | {
        package.removesuffix("/") for package in tree_packages() if package.count("/") == 1
    }
    assert present - placed == set(), f"not in LAYERS: {sorted(present - placed)}"
    assert placed - present <= NOT_YET, f"in LAYERS but not in the tree: {sorted(placed - present - NOT_YET)}"
    with_sub_packages = {package.split("/")[0] for package in tree_packages() if package.count("/") == 2}
    assert set(SUBLAYERS) == with_sub_packages
    for package, order in SUBLAYERS.items():
        subs = {p.split("/")[1] for p in tree_packages() if p.startswith(f"{package}/") and p.count("/") == 2}
        assert {name for layer in order for name in layer} == subs, package


def test_every_package_says_what_it_owns_and_what_it_may_import():
    silent = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        if "May import:" not in docstring:
            silent.append(str(init.relative_to(ROOT)))
    assert not silent, "package docstrings without a 'May import:' paragraph:\n" + "\n".join(silent)


# ---- docs/DESIGN.md -----------------------------------------------------------------------


def _design_blocks() -> list[str]:
    return re.findall(r"```text\n(.*?)```", DESIGN.read_text(encoding="utf-8"), re.DOTALL)


def _order_lines() -> list[str]:
    order = f"{' < '.join(', '.join(layer) for layer in LAYERS)}"
    subs = [f"{package}: {' < '.join(', '.join(layer) for layer in layers)}" for package, layers in SUBLAYERS.items()]
    return [order, *subs]


def test_the_design_doc_states_the_same_layer_order():
    blocks = [block.split("\n") for block in _design_blocks()]
    stated = next((lines for lines in blocks if lines and lines[0].startswith("lazy_exports < ")), None)
    assert stated is not None, "docs/DESIGN.md has no ```text block opening with the layer order"
    assert [line for line in stated if line] == _order_lines()


def _design_map() -> set[str]:
    """The first cells of docs/DESIGN.md's map table: ``layout/``, ``state.py``, ..."""
    text = DESIGN.read_text(encoding="utf-8")
    table = text[text.index("## Map") :].split("\n## ")[0]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def test_the_design_map_names_every_package_and_no_other():
    named = _design_map()
    in_tree = tree_packages() | top_level_modules()
    absent = named - in_tree - {f"{name}/" for name in NOT_YET}
    assert absent == set(), f"docs/DESIGN.md's map names what is not in the tree: {sorted(absent)}"
    assert in_tree - named == set(), f"docs/DESIGN.md's map misses {sorted(in_tree - named)}"


# ---- strings that name modules ------------------------------------------------------------


def _bound_at_top(module: Module) -> set[str]:
    """The names a module binds at its top level (assignments, definitions, imports)."""
    names = set()
    for node in ast.parse(module.path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _reachable(graph: dict[str, Module], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()].imports:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_formats_table_names_readers_at_or_above_the_checkpoint_layer():
    """zeroshard.CHECKPOINT_FORMATS names each format's reader as "module:attribute", so the
    checkpoint layer, whose formats registry every reader imports, imports none of them. Each
    entry names a module that exists and binds the attribute, at or above the checkpoint layer
    (a reader builds on it), and not imported by checkpoint.formats, however indirectly (else
    the string would stand for an import cycle)."""
    import zeroshard

    graph = import_graph()
    below_formats = _reachable(graph, "zeroshard.checkpoint.formats")
    checkpoint = next(index for index, layer in enumerate(LAYERS) if CHECKPOINT_LAYER in layer)
    wrong = []
    for entry in zeroshard.CHECKPOINT_FORMATS:
        name, _, attribute = entry.partition(":")
        if name not in graph:
            wrong.append(f"{entry}: no module {name}")
        elif attribute not in _bound_at_top(graph[name]):
            wrong.append(f"{entry}: {name} binds no {attribute}")
        elif layer_of(name) is None or layer_of(name) < checkpoint:
            wrong.append(f"{entry}: {describe(name)} is below the checkpoint layer")
        elif name in below_formats:
            wrong.append(f"{entry}: zeroshard.checkpoint.formats imports {name}")
    assert zeroshard.CHECKPOINT_FORMATS and not wrong, "\n".join(wrong)


def _lazy_exports(module: Module) -> dict[str, str]:
    """The name -> relative module map a package hands to ``lazy_exports`` (a dict literal,
    inline or bound to a top-level name)."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"))
    dicts = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    exports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            mapping = node.args[1]
            mapping = dicts[mapping.id] if isinstance(mapping, ast.Name) else mapping
            exports.update(ast.literal_eval(mapping))
    return exports


def test_every_lazy_export_names_a_module_that_binds_it():
    """A package's exports imported on first use are strings too: a moved module must not
    leave one naming a path that no longer holds the name."""
    graph = import_graph()
    checked, wrong = 0, []
    for module in graph.values():
        for name, relative in _lazy_exports(module).items():
            level = len(relative) - len(relative.lstrip("."))
            base = module.package.split(".")
            target = ".".join([*base[: len(base) - level + 1], relative.lstrip(".")]).rstrip(".")
            checked += 1
            if target not in graph:
                wrong.append(f"{module.name}: {name} -> {relative}: no module {target}")
            elif name not in _bound_at_top(graph[target]):
                wrong.append(f"{module.name}: {name} -> {relative}: {target} binds no {name}")
    assert not wrong, "\n".join(wrong)
    assert checked > 50
