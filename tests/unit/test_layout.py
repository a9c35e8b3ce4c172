"""The house rules of ``pgbroker/`` that a reader checks first (issue 19): every module is at
most about 600 lines and opens with a docstring that says its one job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "pgbroker").rglob("*.py"))
MAX_LINES = 600


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_is_short_and_says_its_job(path: Path) -> None:
    text = path.read_text("utf-8")
    assert len(text.splitlines()) <= MAX_LINES, "split it: one job per module"
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring and len(docstring.split()) >= 4, "its docstring says its one job"
