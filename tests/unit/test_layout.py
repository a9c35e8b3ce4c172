"""The house rules of ``pgbroker/`` that a reader checks first (issue 19): every module has at
most 450 lines of code and opens with a docstring that says its one job.

Lines of code, not lines: comments and docstrings are free, so that the rule is never met by
trimming the explanations (as a 600-line rule was, issue 28)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "pgbroker").rglob("*.py"))
MAX_CODE_LINES = 450
#: Modules over the rule, each with its budget and reason (none since the consumer's timers and
#: promotion left it, issue 28).
BUDGETS: dict[str, tuple[int, str]] = {}
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER}


def code_lines(text: str) -> int:
    """The lines that hold code: not blank, not only a comment, not part of a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_counts_code_only() -> None:
    text = ('"""Doc\nstring."""\n\n# a comment\nx = 1  # trailing\n\ndef f():\n    """Doc."""\n'
            '    return (1,\n            2)\n')
    assert code_lines(text) == 4  # x = 1, def f():, and the two lines of the return


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_is_short_and_says_its_job(path: Path) -> None:
    text = path.read_text("utf-8")
    budget, _ = BUDGETS.get(str(path.relative_to(ROOT)), (MAX_CODE_LINES, ""))
    assert code_lines(text) <= budget, "split it: one job per module"
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring and len(docstring.split()) >= 4, "its docstring says its one job"
