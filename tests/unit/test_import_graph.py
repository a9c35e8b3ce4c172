"""The import graph of pgbroker and ticketflow, read from the source (nothing is imported).

Every import counts, the ones inside functions too: a circle hidden by a function-level import is
still a circle. The enqueue path and the example app must have none (issue 19).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pgbroker", "ticketflow")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """{module: the modules of these packages it imports anywhere}; a package's ``__init__``
    (the public facade, which imports its rooms) is left out as a target and as a source."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        if is_package:
            continue
        base = name.split(".")
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    origin = ".".join(base[:len(base) - node.level])
                    origin = f"{origin}.{node.module}" if node.module else origin
                else:
                    origin = node.module or ""
                targets.add(origin)
                targets.update(f"{origin}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name
                       and modules[t].name != "__init__.py"}
    return graph


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


@pytest.mark.parametrize("module", [
    "pgbroker.enqueue", "pgbroker._build", "pgbroker._write", "pgbroker._jobs",
    "pgbroker._target", "pgbroker._connector", "pgbroker._broker", "pgbroker.transport",
    "pgbroker.contrib.django", "pgbroker.contrib.django_connector",
    "pgbroker.contrib.sqlalchemy_connector", "ticketflow.services", "ticketflow.tasks",
    "ticketflow.jobs",
])
def test_no_import_circle_through(module: str) -> None:
    graph = _graph()
    assert module in graph
    assert _circle_through(graph, module) is None


def test_the_graph_sees_function_level_imports() -> None:
    """The reader itself: _connector imports the Django connector inside a function."""
    assert "pgbroker.contrib.django_connector" in _graph()["pgbroker._connector"]
