"""The import graph of pgbroker and ticketflow, read from the source (nothing is imported).

Every import counts, the ones inside functions too: a circle hidden by a function-level import is
still a circle, and no module of these packages may sit on one (issue 19). An import inside a
function must say why on its line or in the comment just above it (an optional dependency, a
module a producer need not load, ...): a comment-less one is how a circle gets hidden.

pgbroker's private code lives in wings that import only downwards (issue 28): ``_model`` (what
a job, a message and a claimed row are: no I/O), ``_pg`` (the driver, the statement catalogue,
the store), then ``_produce`` and ``_consume`` side by side, then ``_celery`` (what runs in
Celery's processes). The package's root holds only public modules; a public module sits at the
level of the highest wing it reaches.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pgbroker", "ticketflow")


#: pgbroker's wings, lowest first; wings of one level may not import each other.
WINGS = {"_model": 0, "_pg": 1, "_produce": 2, "_consume": 2, "_celery": 3}


@functools.cache
def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@dataclass(frozen=True)
class Import:
    """One import statement of a module: the module of these packages it loads."""
    target: str
    line: int  # first line of the statement
    end: int  # last line
    in_function: bool


def _origin(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a ``from ... import`` reads from (``package``: the importing module's)."""
    if not node.level:
        return node.module or ""
    origin = ".".join(package[:len(package) - node.level + 1])
    return f"{origin}.{node.module}" if node.module else origin


def _imports(name: str, source: str, is_package: bool,
             modules: dict[str, Path]) -> list[Import]:
    """The imports in the text of module ``name`` whose target is one of ``modules`` (or any
    module, for a function-level one: its target is then the dotted name it imports).

    ``from package import x`` counts as an import of ``package.x`` when that is a module (Python
    loads the submodule, and the package is already being imported as its parent), and of the
    package (its ``__init__``) otherwise.
    """
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                origin = _origin(child, package)
                targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules
                           else origin for alias in child.names]
            else:
                visit(child, inner)
                continue
            for target in dict.fromkeys(targets):
                if target != name and (target in modules or in_function):
                    found.append(Import(target, child.lineno, child.end_lineno or child.lineno,
                                        in_function))

    visit(ast.parse(source), False)
    return found


def _imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    return _imports(name, path.read_text("utf-8"), path.name == "__init__.py", modules)


@functools.cache
def _graph() -> dict[str, set[str]]:
    """{module: the modules of these packages it imports anywhere}, packages' ``__init__``
    included (under the package's name)."""
    modules = _modules()
    return {name: {i.target for i in _imports_of(name, path, modules) if i.target in modules}
            for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _circle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    stack = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_circle_anywhere() -> None:
    graph = _graph()
    assert "pgbroker.transport" in graph and "pgbroker" in graph and "ticketflow.tasks" in graph
    assert _circles(graph) == []


@pytest.mark.parametrize("module", [
    "pgbroker.enqueue", "pgbroker._produce.build", "pgbroker._produce.write", "pgbroker._model.job",
    "pgbroker._produce.transaction", "pgbroker._produce.connectors", "pgbroker._celery.app",
    "pgbroker.transport",
    "pgbroker.contrib.django", "pgbroker._produce.connectors.django_connection",
    "pgbroker._produce.connectors.sqlalchemy_session", "ticketflow.services", "ticketflow.tasks",
    "ticketflow.jobs",
])
def test_no_import_circle_through(module: str) -> None:
    graph = _graph()
    assert module in graph
    assert _circle_through(graph, module) is None


def test_the_graph_sees_function_level_imports() -> None:
    """The reader itself: the connectors import the Django connector inside a function."""
    connectors = _graph()["pgbroker._produce.connectors"]
    assert "pgbroker._produce.connectors.django_connection" in connectors


def test_the_circle_finder_finds_a_circle() -> None:
    """The check itself can fail: a -> b -> c -> a is found, the tail d is not part of it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _says_why(lines: list[str], imp: Import) -> bool:
    """A ``#`` comment on the import's own lines, or just above it: on the comment lines before
    it (or before the group of imports it ends), or on (or above) the headers of the blocks it
    opens (``try:  # optional ...``)."""
    if any("#" in line for line in lines[imp.line - 1:imp.end]):
        return True
    above = imp.line - 2
    while above >= 0:
        code, hashed, _ = lines[above].partition("#")
        if hashed:
            return not code.strip() or code.rstrip().endswith(":")
        if not (code.rstrip().endswith(":") or code.strip().startswith(("import ", "from "))):
            return False
        above -= 1
    return False


def _uncommented_function_level_imports() -> list[str]:
    modules = _modules()
    found = []
    for name, path in modules.items():
        lines = path.read_text("utf-8").splitlines()
        for imp in _imports_of(name, path, modules):
            if imp.in_function and not _says_why(lines, imp):
                found.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}")
    return found


def test_every_function_level_import_says_why() -> None:
    assert _uncommented_function_level_imports() == []


def test_the_comment_check_sees_a_bare_function_level_import() -> None:
    """The check itself can fail: a bare import inside a function is reported, a commented one
    and a module-level one are not."""
    source = ("import os\n"
              "def f():\n"
              "    from . import beat\n"
              "def g():\n"
              "    # optional: flask\n"
              "    import flask\n"
              "def h():\n"
              "    try:  # optional: the admin extra\n"
              "        import flask\n"
              "    except ImportError:\n"
              "        pass\n"
              "def k():\n"
              "    x = 1\n"
              "    if x:\n"
              "        import flask\n")
    lines = source.splitlines()
    imports = _imports("pgbroker._probe", source, False, _modules())
    assert [(i.target, i.line, i.in_function, _says_why(lines, i)) for i in imports] == [
        ("pgbroker.beat", 3, True, False), ("flask", 6, True, True), ("flask", 9, True, True),
        ("flask", 15, True, False)]


def _underscore_reaches(name: str, source: str, is_package: bool,
                        modules: dict[str, Path]) -> list[str]:
    """The underscore names of another module of these packages that module ``name`` uses:
    ``from .x import _y`` (``_y`` not a module), and ``x._y`` on a module ``x`` it imported."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the module of ours it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = _origin(node, package)
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                if sub in modules:
                    bound[alias.asname or alias.name] = sub
                elif (origin in modules and origin != name and alias.name.startswith("_")
                      and not alias.name.startswith("__")):
                    found.append(f"{node.lineno}: from {origin} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{bound[node.value.id]}.{node.attr}" not in modules):
            found.append(f"{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_underscore_names() -> None:
    modules = _modules()
    found = [f"{path.relative_to(ROOT)}:{reach}" for name, path in modules.items()
             for reach in _underscore_reaches(name, path.read_text("utf-8"),
                                              path.name == "__init__.py", modules)]
    assert found == []


def test_the_underscore_check_sees_a_reach() -> None:
    """The check itself can fail: both forms are reported; a private module and its public
    names are not."""
    source = ("from ._pg.driver import _first_line, connect\n"
              "from ._pg import driver as _db, any_connection as _io\n"
              "def f():\n"
              "    return _db._first_line, _db.connect, _io.Stream\n")
    assert _underscore_reaches("pgbroker._probe", source, False, _modules()) == [
        "1: from pgbroker._pg.driver import _first_line", "4: pgbroker._pg.driver._first_line"]


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "pgbroker" and parts[1] in WINGS else None


def _levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each pgbroker module's level: its wing's, or (a public module) the highest level of the
    wing modules it reaches, -1 if none (graph has no circle: test_no_import_circle_anywhere)."""
    levels: dict[str, int] = {}

    def level(module: str) -> int:
        if module not in levels:
            wing = _wing(module)
            levels[module] = WINGS[wing] if wing else max(
                [level(t) for t in graph.get(module, ()) if t.startswith("pgbroker")],
                default=-1)
        return levels[module]

    for module in graph:
        if module.startswith("pgbroker"):
            level(module)
    return levels


def _wing_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a wing module that goes up (to a module of a higher level, a public one
    through what it reaches) or sideways (to another wing of its level)."""
    levels = _levels(graph)
    found = []
    for module, targets in sorted(graph.items()):
        wing = _wing(module)
        if wing is None:
            continue
        for target in sorted(t for t in targets if t in levels):
            other = _wing(target)
            if levels[target] > WINGS[wing]:
                found.append(f"{module} -> {target} (up: level {levels[target]})")
            elif other not in (None, wing) and WINGS[other] == WINGS[wing]:
                found.append(f"{module} -> {target} (sideways)")
    return found


def test_wings_import_only_downwards() -> None:
    graph = _graph()
    assert {_wing(m) for m in graph} >= set(WINGS)
    assert _wing_breaks(graph) == []


def test_the_wing_check_sees_an_upward_and_a_sideways_import() -> None:
    """The check itself can fail: a model module reaching the store through a public module, and
    a consumer module importing a producer one, are reported; downward imports are not."""
    graph = {"pgbroker._model.job": {"pgbroker.settings"},
             "pgbroker.settings": {"pgbroker._pg.store"},
             "pgbroker._pg.store": {"pgbroker._model.job"},
             "pgbroker._consume.turn": {"pgbroker._produce.build", "pgbroker._pg.store"},
             "pgbroker._produce.build": {"pgbroker._model.job"},
             "pgbroker._celery.app": {"pgbroker._consume.turn"}}
    assert _wing_breaks(graph) == [
        "pgbroker._consume.turn -> pgbroker._produce.build (sideways)",
        "pgbroker._model.job -> pgbroker.settings (up: level 1)"]


def test_the_package_root_holds_only_public_modules() -> None:
    """A private module lives in a wing; the root's modules, and the wings, are the list below."""
    root = ROOT / "pgbroker"
    private = sorted(p.name for p in root.glob("_*.py") if p.name not in ("__init__.py",
                                                                           "__main__.py"))
    assert private == []
    wings = sorted(p.name for p in root.iterdir()
                   if p.is_dir() and p.name.startswith("_") and p.name != "__pycache__")
    assert wings == sorted(WINGS)
