"""Reading the database as the tests do: its clock, the ``jobs`` rows, counts per state.

pgbroker trusts only the database's clock, so do the tests: a time a test computes comes from
:func:`db_now`, never from the test process.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

__all__ = ["counts", "db_now", "free_port", "jobs", "rows"]


def db_now(pg: psycopg.Connection) -> datetime:
    """The database clock (``clock_timestamp()``: the moment of the call, not of the
    transaction)."""
    row = pg.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def rows(pg: psycopg.Connection, query: str, *params: Any) -> list[dict[str, Any]]:
    """Every row of ``query`` (``%s`` placeholders, ``params`` in order), as dicts."""
    return pg.cursor(row_factory=dict_row).execute(query, params).fetchall()


def jobs(pg: psycopg.Connection, where: str = "true", params: Any = None,
         schema: str = "pgbroker", order: str = "id") -> list[dict[str, Any]]:
    """Rows of ``<schema>.jobs`` matching ``where`` (SQL, with ``params``), by ``order``
    (default ``id``: oldest first)."""
    with pg.cursor(row_factory=dict_row) as cur:
        return cur.execute(f'SELECT * FROM "{schema}".jobs WHERE {where} ORDER BY {order}',
                           params).fetchall()


def counts(pg: psycopg.Connection, schema: str = "pgbroker") -> Mapping[str, int]:
    """``{state: count}`` over every job row."""
    return dict(pg.execute(f'SELECT state, count(*) FROM "{schema}".jobs GROUP BY state')
                .fetchall())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
