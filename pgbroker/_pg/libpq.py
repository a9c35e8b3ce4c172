"""libpq without blocking in C: send, prepare and collect statements, waiting in Python.

The event loop's claims (:mod:`pgbroker._consume.turn`) and the store's prepared insert run below
psycopg's cursor, on the connection's ``pgconn``. These helpers send a statement whole and read
its results, waiting on the socket in Python: libpq's own blocking calls would neither release
the GIL nor return to Python for a signal (a Ctrl-C) while a lock on the table makes them wait.
The waits are poll()s (:func:`pgbroker._pg.driver.wait_ready`): select() fails above descriptor
1023.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from .driver import wait_ready

__all__ = ["send", "prepare", "run", "finish", "collect", "numbered", "text_arrays", "check",
           "split"]


def send(pgconn: psycopg.pq.abc.PGconn, name: bytes, values: Sequence[bytes | None],
         formats: Sequence[int] | None = None, result_format: int = 0, *,
         text: bytes | None = None, types: Sequence[int] | None = None) -> None:
    """Send a prepared statement on a non-blocking connection, all of it; with ``text``, that
    statement unnamed instead (through a transaction pooler, where nothing stays prepared)."""
    if text is not None:
        pgconn.send_query_params(text, values, types, formats, result_format)
    else:
        pgconn.send_query_prepared(name, values, formats, result_format)
    while pgconn.flush():  # the rest did not fit in the socket buffer yet
        readable, _ = wait_ready(pgconn.socket, write=True)
        if readable:
            pgconn.consume_input()


def prepare(pgconn: psycopg.pq.abc.PGconn, name: bytes, text: bytes,
            types: Sequence[int] | None = None) -> None:
    """PREPARE, waiting in Python (libpq's blocking PQprepare would not return to Python for a
    signal, a Ctrl-C, while it waits: a lock on the table can make it wait)."""
    pgconn.send_prepare(name, text, types)
    finish(pgconn)


def run(pgconn: psycopg.pq.abc.PGconn, command: bytes) -> None:
    """A utility command, waiting for it in Python."""
    pgconn.send_query(command)
    finish(pgconn)


def finish(pgconn: psycopg.pq.abc.PGconn) -> None:
    """Flush what was sent, wait for its results and raise the first error among them."""
    while pgconn.flush():
        wait_ready(pgconn.socket, read=False, write=True)
    results: list[Any] = []
    collect(pgconn, results, wait=True)
    for result in results:
        check(result)


def collect(pgconn: psycopg.pq.abc.PGconn, results: list[Any], wait: bool) -> bool:
    """Append the results of the statement sent to ``results``; True once it has finished.
    ``wait``: block until then (in Python: libpq's own wait would hold the GIL meanwhile)."""
    while True:
        if pgconn.is_busy():
            if not wait:
                return False
            wait_ready(pgconn.socket)
            pgconn.consume_input()
            continue
        res = pgconn.get_result()
        if res is None:
            return True
        results.append(res)


def numbered(query: str) -> tuple[bytes, list[str]]:
    """A query with ``%(name)s`` placeholders as ``$n`` (for a server-side PREPARE), and the
    names in their ``$n`` order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", number, query).replace("%%", "%")
    return text.encode(), names


def text_arrays(deliveries: Sequence[tuple[uuid.UUID, int]]) -> tuple[bytes, bytes]:
    """``(ids, attempts)`` as PostgreSQL array literals (text-format parameters)."""
    ids = ",".join(str(job_id) for job_id, _ in deliveries)
    attempts = ",".join(str(attempt) for _, attempt in deliveries)
    return f"{{{ids}}}".encode(), f"{{{attempts}}}".encode()


def check(result: Any) -> None:
    """Raise the error of a failed result (psycopg's exception for its SQLSTATE)."""
    if result.status == psycopg.pq.ExecStatus.FATAL_ERROR:
        raise psycopg.errors.error_from_result(result)


def split(deliveries: Iterable[tuple[uuid.UUID, int]]) -> tuple[list[uuid.UUID], list[int]]:
    """``(ids, attempts)`` of ``(id, attempt)`` pairs, as two lists (array parameters)."""
    ids: list[uuid.UUID] = []
    attempts: list[int] = []
    for job_id, attempt in deliveries:
        ids.append(job_id)
        attempts.append(attempt)
    return ids, attempts
