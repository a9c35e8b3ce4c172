"""The caller's side of the enqueue tests: an application transaction through each kind of
connection pgbroker accepts (shared by tests/integration/test_enqueue.py and
tests/e2e/test_enqueue_worker.py)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

__all__ = ["KINDS", "Caller", "Recorder", "pgbroker_inserts", "rows_of", "comparable"]

#: SQLAlchemy Session, SQLAlchemy Connection, raw psycopg 3 connection.
KINDS = ["session", "sa_connection", "psycopg"]


class Recorder(psycopg.Cursor):
    """A cursor that records the statements it runs (instrumentation, not a mock: it runs them)."""

    log: list[tuple[str, bool]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Recorder:
        text_ = query if isinstance(query, str) else str(query)
        in_pipeline = self.connection.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF
        Recorder.log.append((text_, in_pipeline))
        return super().execute(query, params, **kwargs)


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
