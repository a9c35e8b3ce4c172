"""Prepared claims are planned again as ``jobs`` grows (``DISCARD PLANS``, ``REPLAN_SECONDS``).

PostgreSQL keeps a prepared statement's plan until an ANALYZE or a schema change. A worker that
starts on an empty table plans its claim for an empty table: the claimed rows are then found by
reading the whole table. Without an ANALYZE (a new schema before autovacuum's first one, or
autovacuum off, as on the machine these tests were written on) that plan would stay while the
table grows. The first two tests show the empty table's plan with its sequential scan (so they
can fail), then fill the table and check that the statement the connection now holds reads
``jobs`` through indexes only; the third, that re-planning keeps the statements prepared.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

import pgbroker._pg.session
from pgbroker._pg.catalogue import queries
from pgbroker._pg.libpq import numbered as _numbered
from tests.support.transport import NO_POLL, LoopConsumer, connect, publish, store_for

INTERVAL = 1.0  # REPLAN_SECONDS for these tests


class Clock:
    """The monotonic clock the store and the event loop read their replan times from, which a
    test moves forward (``advance``) instead of sleeping until a replan is due."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    monkeypatch.setattr(pgbroker._pg.session, "REPLAN_SECONDS", INTERVAL)
    clock = Clock()
    monkeypatch.setattr(pgbroker._pg.session, "monotonic", clock)
    return clock


def grow(pg: psycopg.Connection, rows: int = 20_000) -> None:
    """Jobs of another queue waiting for their eta (finished ones no longer grow the table the
    claim reads: jobs_done, 0020); no ANALYZE."""
    pg.execute("INSERT INTO pgbroker.jobs (id, queue, body, state, run_at) "
               "SELECT gen_random_uuid(), 'later', '\\x00', 'scheduled', now() + interval '1 day' "
               "FROM generate_series(1, %s)", (rows,))
    pg.commit()


def claim_plan(conn: psycopg.Connection, statement: str) -> str:
    """EXPLAIN of ``statement``, a claim prepared on ``conn``, as that session would run it."""
    values = {"queue": "'replan'", "limit": "1", "consumer": f"'{uuid.uuid4()}'",
              "ids": "'{}'", "attempts": "'{}'", "after_priority": "-256",
              "after_run_at": "'-infinity'", "after_id": f"'{uuid.UUID(int=0)}'"}
    _, names = _numbered(queries("pgbroker")["job_claim"])
    args = ", ".join(values[n] for n in names)
    return "\n".join(r[0] for r in conn.execute(f"EXPLAIN EXECUTE {statement}({args})"))


def test_the_event_loop_plans_its_claim_again_once_the_table_grew(
        broker_url: str, pg: psycopg.Connection, clock: Clock) -> None:
    with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
        consumer = LoopConsumer(conn, "replan", prefetch=1)
        publish(producer, "on an empty table", "replan")
        consumer.run_until(lambda: len(consumer.received) == 1)
        listener = conn.transport.consumer.listen()
        consumer.run_until(lambda: not conn.transport.consumer.line.busy)
        assert "Seq Scan on jobs" in claim_plan(listener, "pgbroker_claim")

        grow(pg)
        clock.advance(INTERVAL)
        publish(producer, "on a grown table", "replan")
        consumer.run_until(lambda: len(consumer.received) == 2)
        consumer.run_until(lambda: not conn.transport.consumer.line.busy)
        plan = claim_plan(listener, "pgbroker_claim")
        consumer.hub.close()
    assert "Seq Scan on jobs" not in plan, plan
    assert "jobs_claim_idx" in plan, plan


def test_the_store_plans_its_statements_again_once_the_table_grew(
        db_url: str, pg: psycopg.Connection, clock: Clock) -> None:
    store = store_for(db_url)
    consumer = uuid.uuid4()

    def prepared_claim() -> str:
        """The claim as psycopg prepared it (at its 5th execution) on the store's connection."""
        for _ in range(6):
            assert store.claim("replan", 1, consumer) == []
        return store.conn.execute(
            "SELECT name FROM pg_prepared_statements "
            "WHERE statement LIKE '%%candidates AS MATERIALIZED%%'").fetchone()[0]

    try:
        assert "Seq Scan on jobs" in claim_plan(store.conn, prepared_claim())
        grow(pg)
        clock.advance(INTERVAL)
        plan = claim_plan(store.conn, prepared_claim())
    finally:
        store.close()
    assert "Seq Scan on jobs" not in plan, plan
    assert "jobs_claim_idx" in plan, plan


def test_statements_prepared_between_two_replans_still_run(db_url: str, clock: Clock) -> None:
    """Only the plans go: the statements psycopg prepared stay usable. (Found when the first
    replan, with nothing prepared yet, made psycopg ignore the next one's DEALLOCATE ALL, and
    a publish failed: 'prepared statement "_pg3_0" does not exist'.)"""
    store = store_for(db_url)
    consumer = uuid.uuid4()
    try:
        store.connect()
        for _ in range(2):
            clock.advance(INTERVAL)  # a replan before any statement was prepared, then another
            for _ in range(7):  # psycopg prepares the claim at its 5th execution
                assert store.claim("replan", 1, consumer) == []
    finally:
        store.close()
