"""The caller's side of the enqueue tests: an application transaction through each kind of
connection pgbroker accepts, synchronous (:class:`Caller`) and asyncio (:class:`AsyncCaller`)
(shared by tests/integration/test_enqueue*.py and tests/e2e/test_enqueue_worker.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

__all__ = ["ASYNC_KINDS", "KINDS", "AsyncCaller", "AsyncRecorder", "Caller", "Recorder",
           "asynchronous", "comparable", "opened", "pgbroker_inserts", "rows_of"]

#: SQLAlchemy Session, SQLAlchemy Connection, raw psycopg 3 connection.
KINDS = ["session", "sa_connection", "psycopg"]

#: Their asyncio forms: SQLAlchemy AsyncSession and AsyncConnection, psycopg AsyncConnection.
ASYNC_KINDS = ["async_session", "async_sa_connection", "async_psycopg"]


class Recorder(psycopg.Cursor):
    """A cursor that records the statements it runs (instrumentation, not a mock: it runs them)."""

    log: list[tuple[str, bool]] = []

    @staticmethod
    def note(cursor: Any, query: Any) -> None:
        """Log ``query``, run by ``cursor``, and whether it went in a pipeline."""
        pipeline = cursor.connection.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF
        Recorder.log.append((query if isinstance(query, str) else str(query), pipeline))

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Recorder:
        Recorder.note(self, query)
        return super().execute(query, params, **kwargs)


class AsyncRecorder(psycopg.AsyncCursor):
    """:class:`Recorder` for an asyncio connection (into the same log)."""

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> AsyncRecorder:
        Recorder.note(self, query)
        return await super().execute(query, params, **kwargs)


def pgbroker_inserts() -> list[tuple[str, bool]]:
    return [entry for entry in Recorder.log if 'INSERT INTO "pgbroker".jobs' in entry[0]]


def rows_of(conn: psycopg.Connection, ids: list[Any]) -> list[dict[str, Any]]:
    """The jobs ``ids`` (as seen by ``conn``, inside its transaction too), in the order given."""
    cur = conn.cursor(row_factory=dict_row)
    found = {row["id"]: row for row in cur.execute(
        "SELECT * FROM pgbroker.jobs WHERE id = ANY(%s)", (ids,))}
    return [found[job_id] for job_id in ids]


#: What differs between two messages of the same task, arguments and options: the ids made for
#: each, and the times of the transaction that wrote it.
ROW_VARIES = frozenset({"id", "task_id", "created_at", "updated_at", "run_at", "expires_at",
                        "message_digest"})
HEADERS_VARY = frozenset({"id", "root_id", "eta", "expires"})


def comparable(row: dict[str, Any], *, times: bool = False) -> dict[str, Any]:
    """``row`` without what differs between two messages of the same call (``times``: keep
    run_at and expires_at, for rows written in the same transaction); the body as bytes. Checks
    that the row's own ids agree (headers, properties and column)."""
    headers, properties = row["headers"], row["properties"]
    assert headers["id"] == row["task_id"] == properties["correlation_id"], row
    keep = {"run_at", "expires_at"} if times else set()
    return {
        **{k: v for k, v in row.items() if k not in ROW_VARIES or k in keep},
        "body": bytes(row["body"]),
        "headers": {k: v for k, v in headers.items()
                    if k not in HEADERS_VARY or (times and k in ("eta", "expires"))},
        "properties": {k: v for k, v in properties.items() if k != "correlation_id"},
    }


class Caller:
    """One open transaction of the application, through one kind of connection."""

    def __init__(self, kind: str, db_url: str):
        self.kind = kind
        self.engine: Engine | None = None
        if kind == "psycopg":
            self.conn = psycopg.connect(db_url, cursor_factory=Recorder)
            self.db: Any = self.conn
        else:
            self.engine = create_engine(
                db_url.replace("postgresql://", "postgresql+psycopg://", 1),
                connect_args={"cursor_factory": Recorder})
            self.db = Session(self.engine) if kind == "session" else self.engine.connect()

    def execute(self, sql: str) -> list[Any]:
        if self.kind == "psycopg":
            cur = self.conn.execute(sql)
            return cur.fetchall() if cur.description else []
        result = self.db.execute(text(sql))
        return list(result) if result.returns_rows else []

    def commit(self) -> None:
        self.db.commit()

    def rollback(self) -> None:
        self.db.rollback()

    def close(self) -> None:
        self.db.close()
        if self.engine is not None:
            self.engine.dispose()


class AsyncCaller:
    """One open transaction of an asyncio application, through one kind of async connection
    (``await AsyncCaller.open(kind, db_url)``)."""

    def __init__(self, kind: str, db: Any, engine: AsyncEngine | None):
        self.kind = kind
        self.db = db
        self.engine = engine

    @classmethod
    async def open(cls, kind: str, db_url: str) -> AsyncCaller:
        if kind == "async_psycopg":
            conn = await psycopg.AsyncConnection.connect(db_url, cursor_factory=AsyncRecorder)
            return cls(kind, conn, None)
        engine = create_async_engine(  # postgresql+psycopg:// is psycopg's async driver here
            db_url.replace("postgresql://", "postgresql+psycopg://", 1),
            connect_args={"cursor_factory": AsyncRecorder})
        if kind == "async_session":
            return cls(kind, AsyncSession(engine), engine)
        return cls(kind, await engine.connect(), engine)

    async def execute(self, sql: str) -> list[Any]:
        if self.kind == "async_psycopg":
            cur = await self.db.execute(sql)
            return await cur.fetchall() if cur.description else []
        result = await self.db.execute(text(sql))
        return list(result) if result.returns_rows else []

    async def commit(self) -> None:
        await self.db.commit()

    async def rollback(self) -> None:
        await self.db.rollback()

    async def close(self) -> None:
        await self.db.close()
        if self.engine is not None:
            await self.engine.dispose()


@contextlib.asynccontextmanager
async def opened(kind: str, db_url: str) -> AsyncIterator[AsyncCaller]:
    """An :class:`AsyncCaller`, closed when the block is left."""
    caller = await AsyncCaller.open(kind, db_url)
    try:
        yield caller
    finally:
        await caller.close()


def asynchronous(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """A coroutine test function as a plain one (pytest runs it, with its fixtures): run on an
    event loop of its own, so no pytest plugin is needed."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return run
