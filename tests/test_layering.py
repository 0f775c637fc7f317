"""The import graph follows one stated layer order, has no cycle, and gives each name one home.

The graph is read from the source (an ``ast`` walk of every module of ``src/specstate``: imports at
module level, under ``TYPE_CHECKING`` and inside functions all count). docs/design.md states the
same order in words; a new import that runs back up the order, closes a cycle, or reaches a name
through a module that does not define it fails here with the import named.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors", ("specstate.core.errors",)),
    ("grammar values", ("specstate.grammar",)),
    ("core", ("specstate.core",)),
    ("memory", ("specstate.memory",)),
    ("relay", ("specstate.relay",)),
    ("handoff records", ("specstate.handoff",)),
    ("batch", ("specstate.batch",)),
    ("engine owners", ("specstate.engine",)),
    ("capabilities", ("specstate.engine.capabilities",)),
    (
        "the round",
        (
            "specstate.engine.rounds",
            "specstate.engine.compose",
            "specstate.engine.engine",
            "specstate.engine.stream",
            "specstate.engine.metrics",
        ),
    ),
    (
        "front ends",
        (
            "specstate.serving",
            "specstate.distributed",
            "specstate.reference",
            "specstate.handoff.link",
            "specstate.handoff.transport",
            "specstate.handoff.launch",
        ),
    ),
    ("testing", ("specstate.testing",)),
    ("public faces", ("specstate", "specstate.internals")),
    ("tools", ("specstate.tools", "specstate.lint")),
)
"""Bottom to top: a module may import only from its own layer and the layers below it. A module
belongs to the layer of its longest matching prefix (``specstate.engine.capabilities.grammar`` is a
capability, ``specstate.engine.settle.results`` an engine owner)."""

FACES = frozenset({"specstate", "specstate.internals"})
"""The two public faces: they re-export what other modules define."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted((SRC / "specstate").rglob("*.py"))}
TREES: dict[str, ast.Module] = {
    m: ast.parse(p.read_text(encoding="utf-8")) for m, p in MODULES.items()
}


def layer_of(module: str) -> int:
    """The index in `LAYERS` of ``module``'s longest matching prefix."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def _imports(module: str) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names) of every import in ``module`` that names a project module."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if target in MODULES and len(submodules) < len(names):
                yield node.lineno, target, tuple(n for n in names if f"{target}.{n}" not in MODULES)
            for sub in submodules:
                yield node.lineno, sub, ()


EDGES: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {
    m: [e for e in _imports(m) if e[1] != m] for m in MODULES
}


def test_every_module_is_in_a_layer() -> None:
    """Each module of the package belongs to exactly one layer of `LAYERS`."""
    for module in MODULES:
        layer_of(module)


def test_imports_follow_the_layer_order() -> None:
    """No module imports from a layer above its own."""
    back = [
        f"{MODULES[m].relative_to(SRC)}:{line}: {m} ({LAYERS[layer_of(m)][0]}) imports {target} "
        f"({LAYERS[layer_of(target)][0]})"
        for m, edges in EDGES.items()
        for line, target, _ in edges
        if layer_of(target) > layer_of(m)
    ]
    assert not back, "imports that run back up the layer order:\n" + "\n".join(back)


def test_the_import_graph_has_no_cycle() -> None:
    """Following imports from any module never leads back to it."""
    graph = {m: sorted({t for _, t, _ in edges}) for m, edges in EDGES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[module] = 2
        path.pop()
        return None

    for module in graph:
        if module not in state:
            cycle = visit(module)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _defined(module: str) -> set[str]:
    """The names ``module`` defines at its top level (classes, functions, assignments)."""
    names: set[str] = set()
    for node in TREES[module].body:
        nodes = [node]
        if isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING or fallback definitions
            nodes = [*node.body, *node.orelse]
        for sub in nodes:
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(sub.name)
            elif isinstance(sub, ast.Assign):
                names.update(
                    n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name)
                )
            elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                names.add(sub.target.id)
    return names


def _is_shim_free(module: str) -> bool:
    return module not in FACES and MODULES[module].name != "__init__.py"


def test_no_module_re_exports_a_name_it_does_not_define() -> None:
    """Only the public faces and package ``__init__`` modules list another module's names in
    their ``__all__``."""
    found = []
    for module in filter(_is_shim_free, MODULES):
        defined = _defined(module)
        for node in TREES[module].body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = ast.literal_eval(node.value)
                found += [f"{module}.__all__ lists {n}" for n in listed if n not in defined]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("root", ["src", "tests", "examples", "benchmarks", "scripts"])
def test_every_import_names_the_module_that_defines_it(root: str) -> None:
    """``from specstate.x import name`` takes ``name`` from the module that defines it (or
    from a public face or package)."""
    base = SRC.parent / root
    found = []
    for path in sorted(base.rglob("*.py")):
        if "snippets" in path.parts:
            continue  # typing snippets import wrong names on purpose
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in MODULES:
                continue
            module = node.module
            if not _is_shim_free(module):
                continue
            defined = _defined(module)
            found += [
                f"{path.relative_to(SRC.parent)}:{node.lineno}: {a.name} from {module}"
                for a in node.names
                if a.name not in defined and f"{module}.{a.name}" not in MODULES
            ]
    assert not found, "imports through a module that does not define the name:\n" + "\n".join(found)


def test_the_front_ends_do_not_import_each_other() -> None:
    """serving, distributed and reference stand side by side on the engine: none imports another."""
    fronts = ("specstate.serving", "specstate.distributed", "specstate.reference")

    def front(module: str) -> str | None:
        return next((f for f in fronts if module == f or module.startswith(f + ".")), None)

    crossing = [
        f"{MODULES[m].relative_to(SRC)}:{line}: {m} imports {target}"
        for m, edges in EDGES.items()
        for line, target, _ in edges
        if front(m) and front(target) and front(m) != front(target)
    ]
    assert not crossing, "\n".join(crossing)
