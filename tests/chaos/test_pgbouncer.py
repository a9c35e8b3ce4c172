"""pgbroker through a real PgBouncer in transaction pooling mode.

Producers (``.delay()``, ``pgbroker.enqueue``, ``pgbroker.transaction()``) and workers connect
through ``pgbouncer`` (Debian's package, started by the test: tests/chaos/pgbouncer_fixture.py)
with ``pool_mode = transaction``. To make "no session state" certain rather than a matter of
which server connection PgBouncer happens to hand out, the pooler runs ``DISCARD ALL`` after
every transaction (``server_reset_query_always``): prepared statements, LISTEN, session advisory
locks and ``SET`` all end with the transaction, as they may on a busy production pooler.

Counts from SQL on the server itself (not through the pooler).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

import pgbroker
from tests.chaos.pgbouncer_fixture import PgBouncer, pgbouncer
from tests.apps import e2e_app as e2e
from tests.support.workers import SHORT_LEASE, key_runs, start_worker
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import wait_for

@pytest.fixture
def bouncer(runs: psycopg.Connection) -> Iterator[PgBouncer]:
    with pgbouncer("127.0.0.1", runs.info.port, reset_always=True) as made:
        yield made


def _latency(pg: psycopg.Connection, key: str) -> float:
    """Publish one task to the idle worker; seconds from its row's creation to its start."""
    e2e.touch.apply_async((key,), task_id=key)
    wait_for(lambda: key_runs(pg, key), 30, interval=0.02, message=f"{key} to run")
    created = pg.execute("SELECT created_at FROM pgbroker.jobs WHERE task_id = %s",
                         (key,)).fetchone()[0]
    return (key_runs(pg, key)[0]["at"] - created).total_seconds()


def _jobs(pg: psycopg.Connection, prefix: str) -> int:
    return pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_id LIKE %s",
                      (prefix + "%",)).fetchone()[0]


@pytest.mark.parametrize("options", [{}, {"transaction_pooling": True}],
                         ids=["found-out", "said"])
def test_delay_through_transaction_pooling(bouncer: PgBouncer, db_url: str,
                                           runs: psycopg.Connection,
                                           options: dict[str, bool]) -> None:
    """``.delay()`` through the pooler, told so or finding out at the first statement it broke
    (a prepared statement gone: nothing was written, the statement is sent again)."""
    point_producer(e2e.app, "pgbroker+" + bouncer.url(db_url), options)
    try:
        for i in range(20):  # psycopg too prepares a statement at its 5th execution
            e2e.touch.apply_async((f"delay-{i}",), task_id=f"delay-{i}")
    finally:
        drop_pools(e2e.app)
    assert _jobs(runs, "delay-") == 20


def test_enqueue_and_transaction_through_transaction_pooling(
        bouncer: PgBouncer, db_url: str, runs: psycopg.Connection) -> None:
    """The caller's connection (``prepare_threshold=None``, as PgBouncer's docs ask of psycopg
    clients before 1.21): ``enqueue`` and ``transaction()`` add no session state to it."""
    with psycopg.connect(bouncer.url(db_url), prepare_threshold=None) as conn:
        for i in range(10):
            pgbroker.enqueue(conn, e2e.touch, (f"enq-{i}",), app=e2e.app)
            conn.commit()
        point_producer(e2e.app, "pgbroker+" + db_url)  # not used: transaction() writes via conn
        with pgbroker.transaction(conn):
            for i in range(10):
                e2e.touch.apply_async((f"txn-{i}",), task_id=f"txn-{i}")
        conn.commit()
    drop_pools(e2e.app)
    assert _jobs(runs, "txn-") == 10
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs WHERE convert_from(body, 'UTF8')"
                        " LIKE '%enq-%'"
                        ).fetchone()[0] == 10


def test_worker_through_transaction_pooling(bouncer: PgBouncer, db_url: str,
                                            runs: psycopg.Connection,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose every connection goes through the pooler (``transaction_pooling``): no
    LISTEN (claims every ``poll_interval``), no advisory lock (heartbeats are the guarantee),
    nothing prepared."""
    point_producer(e2e.app, "pgbroker+" + db_url)
    # the tasks record their runs directly (psycopg's own prepared statements are the test's
    # concern, not the broker's)
    monkeypatch.setenv("PGBROKER_TEST_RUNS_URL", db_url)
    try:
        start_worker("pgbroker+" + bouncer.url(db_url), "-c", "2", options={
            **SHORT_LEASE, "transaction_pooling": True, "poll_interval": 0.5})
        keys = [f"pooled-{i}" for i in range(30)]
        for key in keys:
            e2e.touch.apply_async((key,), task_id=key)
        wait_for(lambda: runs.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_id ="
                                      " ANY(%s) AND state = 'completed'", (keys,)
                                      ).fetchone()[0] == len(keys), 60, interval=0.2,
                 message="every task completed through the pooler")
        latencies = [_latency(runs, f"probe-{i}") for i in range(10)]
    finally:
        drop_pools(e2e.app)
    latencies.sort()
    print(f"\n[figure] worker through PgBouncer, poll-only (poll_interval 0.5 s): publish->start "
          f"p50 {latencies[5] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms over 10 "
          "tasks sent one at a time to the idle worker")
    runs_per_key = dict(runs.execute("SELECT key, count(*) FROM public.runs WHERE key = ANY(%s)"
                                     " GROUP BY key", (keys,)).fetchall())
    assert runs_per_key == dict.fromkeys(keys, 1)
