"""The layout of the test tree, read from the source (nothing is imported): a tier imports no
other tier.

A tier is a directory of tests/ (unit, integration, e2e, chaos, bench, ...). A module of a tier
may import its own tier, :mod:`tests.support` (helpers), :mod:`tests.apps` (the applications the
tests run) and anything outside tests/; :mod:`tests.support`, :mod:`tests.apps` and the files at
the top of tests/ (``conftest.py``) import no tier. What several tiers need lives in one of the
two shared packages, so that a tier can be read, run and moved alone.

Every import counts, the ones inside functions too, and so does a module named in a string --
``celery -A tests.apps.e2e_app worker`` imports it in the worker process -- when the string is
exactly the dotted name of a module of the tree (a docstring is not an import).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SHARED = ("support", "apps")
_DOTTED = re.compile(r"tests(\.[A-Za-z_][A-Za-z0-9_]*)+")


@dataclass(frozen=True)
class Crossing:
    """One import of a module of another tier."""
    path: str  # relative to the directory above tests/
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def _modules(tests: Path) -> dict[str, Path]:
    """Every module of the tree by its dotted name (``tests.e2e.test_worker``)."""
    found = {}
    for path in sorted(tests.rglob("*.py")):
        parts = list(path.relative_to(tests.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _tier(name: str, tests: Path) -> str | None:
    """The tier of module ``tests.<tier>...`` (a directory of ``tests``): None for the files at
    the top of tests/ and for what is not the tests'."""
    parts = name.split(".")
    if parts[0] != "tests" or len(parts) < 2 or not (tests / parts[1]).is_dir():
        return None
    return parts[1]


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _targets(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, dotted name) of every module of tests/ that module ``name`` imports or names."""
    tree = ast.parse(path.read_text("utf-8"))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            for alias in node.names:  # ``from tests import e2e`` imports the module tests.e2e
                sub = f"{origin}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else origin))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and _DOTTED.fullmatch(node.value)
              and node.value in modules):
            found.append((node.lineno, node.value))
    return [(line, target) for line, target in found
            if target == "tests" or target.startswith("tests.")]


def crossings(tests: Path) -> list[Crossing]:
    """Every import in the tree under ``tests`` of a tier other than the importer's own."""
    modules = _modules(tests)
    found = []
    for name, path in modules.items():
        mine = _tier(name, tests)
        for line, target in _targets(name, path, modules):
            theirs = _tier(target, tests)
            if theirs is not None and theirs not in SHARED and theirs != mine:
                found.append(Crossing(str(path.relative_to(tests.parent)), line, target))
    return found


def test_no_tier_imports_another_tier() -> None:
    found = crossings(TESTS)
    assert not found, ("move what two tiers share into tests/support (helpers) or tests/apps "
                       "(applications):\n" + "\n".join(map(str, found)))


def test_the_tiers_are_found() -> None:
    """The check reads the real tree: the tiers it knows and the imports it follows."""
    tiers = {_tier(name, TESTS) for name in _modules(TESTS)} - {None}
    assert {"unit", "integration", "e2e", "chaos", "bench", "support", "apps"} <= tiers
    targets = {t for _, t in _targets("tests.conftest", TESTS / "conftest.py", _modules(TESTS))}
    assert "tests.support.databases" in targets


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "tests"


def test_the_check_finds_a_crossing(tmp_path: Path) -> None:
    """The check can fail: a synthetic tree with each kind of crossing, and with each kind of
    allowed import, which it must let through."""
    tests = _write(tmp_path, {
        "tests/__init__.py": "",
        "tests/conftest.py": "from tests.support import helpers\n",
        "tests/support/__init__.py": "",
        "tests/support/helpers.py": "def f():\n    from tests.e2e import app  # in a function\n",
        "tests/apps/__init__.py": "",
        "tests/apps/shared_app.py": "import celery\nfrom tests.support.helpers import f\n",
        "tests/e2e/__init__.py": "",
        "tests/e2e/app.py": '"""Run as tests.e2e.app: a docstring, not an import."""\n',
        "tests/e2e/test_a.py": ("from tests.e2e import app\nfrom . import app as again\n"
                                "from tests.apps import shared_app\nimport psycopg\n"
                                "WORKER = ['-A', 'tests.apps.shared_app']\n"),
        "tests/chaos/__init__.py": "",
        "tests/chaos/test_b.py": ("from tests import e2e\nfrom tests.e2e.app import x\n"
                                  "ARGS = ['celery', '-A', 'tests.e2e.app', 'worker']\n"
                                  "TASK = 'tests.e2e.app.touch'  # a task name: no module\n"),
        "tests/unit/__init__.py": "",
        "tests/unit/test_c.py": "from ..chaos import test_b\nfrom tests.support import helpers\n",
    })
    assert sorted(map(str, crossings(tests))) == [
        "tests/chaos/test_b.py:1 imports tests.e2e",
        "tests/chaos/test_b.py:2 imports tests.e2e.app",
        "tests/chaos/test_b.py:3 imports tests.e2e.app",
        "tests/support/helpers.py:2 imports tests.e2e.app",
        "tests/unit/test_c.py:1 imports tests.chaos.test_b",
    ]


@pytest.mark.parametrize(("name", "tier"), [
    ("tests.e2e.test_no_such_module", "e2e"), ("tests.unit", "unit"),
    ("tests.support.db", "support"),
    ("tests.conftest", None), ("tests", None), ("pgbroker.transport", None)])
def test_the_tier_of_a_module(name: str, tier: str | None) -> None:
    assert _tier(name, TESTS) == tier
