"""Reading the database as the tests do: its clock, the ``jobs`` rows, counts per state; job
rows made with SQL in the states the transport leaves (:func:`add_job`); and a deterministic
disk-full fault (:func:`disk_full_when`).

pgbroker trusts only the database's clock, so do the tests: a time a test computes comes from
:func:`db_now`, never from the test process.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

__all__ = ["CHILD_KILLED", "CHILD_LOST", "LOST", "add_job", "add_jobs", "counts", "db_now",
           "disk_full_when", "free_port", "job", "job_fields", "job_state", "jobs", "rows"]


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


def job(pg: psycopg.Connection, task_id: str | None = None, *, id: Any = None) -> dict[str, Any]:
    """The single job row of a Celery task id (or of a job ``id``), with the database's
    ``now()`` as ``db_now``; fails unless exactly one row matches."""
    column, value = ("task_id", task_id) if id is None else ("id", id)
    found = rows(pg, f"SELECT *, now() AS db_now FROM pgbroker.jobs WHERE {column} = %s"
                     " ORDER BY retries", value)
    assert len(found) == 1, f"expected one job row for {column} {value}, found {len(found)}"
    return found[0]


def job_fields(pg: psycopg.Connection, *names: str, task_id: str | None = None,
               id: Any = None) -> tuple[Any, ...] | None:
    """Columns ``names`` of the job row of a Celery task id (or of a job ``id``), as a tuple;
    None when there is no such row."""
    column, value = ("task_id", task_id) if id is None else ("id", id)
    return pg.execute(f"SELECT {', '.join(names)} FROM pgbroker.jobs WHERE {column} = %s",
                      (value,)).fetchone()


def job_state(pg: psycopg.Connection, task_id: str | None = None, *, id: Any = None) -> str | None:
    """The state of the job row of a Celery task id (or of a job ``id``); None when there is
    no such row."""
    found = job_fields(pg, "state", task_id=task_id, id=id)
    return found[0] if found else None


def counts(pg: psycopg.Connection, schema: str = "pgbroker") -> Mapping[str, int]:
    """``{state: count}`` over every job row."""
    return dict(pg.execute(f'SELECT state, count(*) FROM "{schema}".jobs GROUP BY state')
                .fetchall())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- rows as the transport leaves them (fabricated with SQL) ---------------------------------------

#: The ``last_error`` of jobs buried after three attempts, as the sweeper and transport word it.
LOST = ("max attempts (3) reached: its consumer was lost (worker killed or unreachable) during "
        "every attempt")
CHILD_KILLED = "max attempts (3) reached; last: requeued by the consumer"
CHILD_LOST = ("max attempts (3) reached; last: requeued by the worker: its pool process was lost "
              "(killed or out of memory, with task_reject_on_worker_lost), or the task raised "
              "Reject(requeue=True)")


def add_job(pg: psycopg.Connection, state: str, queue: str = "q1", task: str | None = "t.a",
            **cols: Any) -> uuid.UUID:
    """Insert one job row in ``state`` (as the transport would have left it)."""
    row: dict[str, Any] = {"id": uuid.uuid4(), "queue": queue, "task": task, "body": b"{}",
                           "state": state, **cols}
    if state == "running":
        row.setdefault("locked_by", uuid.uuid4())
        row.setdefault("attempts", 1)
    names = ", ".join(row)
    marks = ", ".join(f"%({k})s" for k in row)
    pg.execute(f"INSERT INTO pgbroker.jobs ({names}) VALUES ({marks})", row)
    return row["id"]


def add_jobs(pg: psycopg.Connection, n: int, state: str, **kw: Any) -> None:
    for _ in range(n):
        add_job(pg, state, **kw)


def disk_full_when(pg: psycopg.Connection, table: str, condition: str) -> None:
    """A full disk for the writes to ``table`` where ``condition`` holds (SQL over ``NEW``): a
    ``BEFORE INSERT OR UPDATE`` trigger raises SQLSTATE 53100 (disk_full) on a connection that
    lives on. A ``nextval()`` in ``condition`` counts the writes (it is not undone when the
    statement fails)."""
    name = "disk_full_" + table.replace(".", "_")
    pg.execute(f"""
        CREATE FUNCTION public.{name}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {condition} THEN
                RAISE EXCEPTION 'disk full (test)' USING ERRCODE = 'disk_full';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER {name} BEFORE INSERT OR UPDATE ON {table}
            FOR EACH ROW EXECUTE FUNCTION public.{name}();
    """)
