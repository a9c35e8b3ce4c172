"""The named queries of ``sql/*.sql`` and the one way to run them.

Each feature keeps its statements in a file of its own (``queries.sql`` is the core), as named
blocks (``-- name: job_insert``), loaded once per schema. :class:`Queries` runs one named
statement over a caller's connection, with database errors translated to pgbroker's: every module
that runs SQL does it through here (procrastinate's ``manager.py`` over its ``connector.py``).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg.rows import RowFactory, dict_row, tuple_row

from . import any_connection as _io
from . import driver as _db

__all__ = ["queries", "Queries", "without_comment_lines"]

_BLOCK_RE = re.compile(r"^-- name: (\w+)\s*$", re.M)


@cache
def queries(schema: str) -> dict[str, str]:
    """The named queries of every ``sql/*.sql`` file, for ``schema`` (validated by Settings).

    A name defined twice is an error.
    """
    found: dict[str, str] = {}
    folder = resources.files("pgbroker").joinpath("sql")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        parts = _BLOCK_RE.split(entry.read_text("utf-8"))[1:]
        for name, body in zip(parts[::2], parts[1::2]):
            if name in found:
                raise RuntimeError(f"query {name!r} is defined twice (in {entry.name})")
            found[name] = without_comment_lines(body.replace("{schema}", f'"{schema}"')).strip()
    return found


def without_comment_lines(text: str) -> str:
    """``text`` without the lines that are only a comment (the why of each step, for readers):
    psycopg caches its conversion of a query of at most 4,096 bytes only, and parses a longer one
    again at every execution (about 0.1 ms for job_insert, whose comments made it longer). A line
    inside a quoted literal or identifier is kept, whatever it holds."""
    kept, quote = [], ""
    for line in text.splitlines():
        if not quote and line.lstrip().startswith("--"):
            continue
        kept.append(line)
        i = 0
        while i < len(line):
            if quote:
                quote = "" if line[i] == quote else quote
            elif line[i] in "'\"":
                quote = line[i]
            elif line.startswith("--", i):
                break  # a comment after the code: the rest of the line
            i += 1
    return "\n".join(kept)


class Queries:
    """The named statements of one schema, run over a connection the caller holds.

    Every method is one statement; a database error becomes pgbroker's own (``errors.py``),
    named after the statement (``what``, default ``"pgbroker <name>"``).
    """

    def __init__(self, schema: str):
        self.schema = schema
        self.text = queries(schema)

    def __getitem__(self, name: str) -> str:
        return self.text[name]

    def execute(self, conn: psycopg.Connection[Any], name: str,
                params: Any = None, *, row_factory: RowFactory[Any] = tuple_row,
                binary: bool = False, what: str | None = None) -> psycopg.Cursor[Any]:
        """Run ``name`` and return its cursor (rows not fetched yet)."""
        with _db.translate_errors(what or f"pgbroker {name}"):
            cur = conn.cursor(row_factory=row_factory, binary=binary)
            return cur.execute(self.text[name], params)

    def all(self, conn: psycopg.Connection[Any], name: str, params: Any = None,
            **kw: Any) -> list[Any]:
        """Every row of ``name`` (tuples; ``row_factory=dict_row`` for dicts)."""
        with _db.translate_errors(kw.get("what") or f"pgbroker {name}"):
            return self.execute(conn, name, params, **kw).fetchall()

    def dicts(self, conn: psycopg.Connection[Any], name: str, params: Any = None,
              **kw: Any) -> list[dict[str, Any]]:
        """Every row of ``name``, as dicts."""
        return self.all(conn, name, params, row_factory=dict_row, **kw)

    def one(self, conn: psycopg.Connection[Any], name: str, params: Any = None,
            **kw: Any) -> Any:
        """The first row of ``name``, or None."""
        with _db.translate_errors(kw.get("what") or f"pgbroker {name}"):
            return self.execute(conn, name, params, **kw).fetchone()

    async def aexecute(self, conn: Any, name: str, params: Any = None, *,
                       row_factory: RowFactory[Any] = tuple_row, what: str | None = None) -> Any:
        """:meth:`execute` as a coroutine, on a psycopg ``AsyncConnection`` or ``Connection``
        (then it never suspends: see :mod:`pgbroker._pg.any_connection`)."""
        with _db.translate_errors(what or f"pgbroker {name}"):
            cur = conn.cursor(row_factory=row_factory)
            return await _io.awaited(cur.execute(self.text[name], params))

    async def aall(self, conn: Any, name: str, params: Any = None, **kw: Any) -> list[Any]:
        """:meth:`all` as a coroutine (see :meth:`aexecute`)."""
        with _db.translate_errors(kw.get("what") or f"pgbroker {name}"):
            cur = await self.aexecute(conn, name, params, **kw)
            return await _io.awaited(cur.fetchall())  # type: ignore[no-any-return]

    def rowcount(self, conn: psycopg.Connection[Any], name: str, params: Any = None,
                 **kw: Any) -> int:
        """How many rows ``name`` changed."""
        return self.execute(conn, name, params, **kw).rowcount
