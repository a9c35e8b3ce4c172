"""Cluster-wide rate limits (issue 22, point 3) against a real PostgreSQL: the claim statement
from several consumers at once. With three real workers: tests/e2e/test_job_keys_worker.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from pgbroker._consume.lease import Lease
from pgbroker._consume.lease import write_rate_limits
from pgbroker._model.rate_limits import parse_rate_limits
from pgbroker._pg.store import Store
from tests.support.processes import wait_for
from tests.support.transport import counts, new_job, store_for


def limit(pg: psycopg.Connection, rates: dict[str, str]) -> None:
    write_rate_limits(pg, "pgbroker", parse_rate_limits(rates))


def job(task: str) -> object:
    return new_job("q", task=task)


def most_claims_in_a_window(pg: psycopg.Connection, task: str, seconds: float) -> int:
    """The most first claims (attempt 1, locked_at: the claim's time) of ``task`` in any
    half-open window of ``seconds``."""
    return pg.execute("""
        SELECT coalesce(max(n), 0) FROM (
            SELECT (SELECT count(*) FROM pgbroker.jobs AS b
                    WHERE b.task = a.task AND b.locked_at >= a.locked_at
                      AND b.locked_at < a.locked_at + make_interval(secs => %s)) AS n
            FROM pgbroker.jobs AS a WHERE a.task = %s AND a.locked_at IS NOT NULL) AS w""",
                      (seconds, task)).fetchone()[0]


def test_claims_beyond_the_limit_wait_in_the_database(db_url: str, pg: psycopg.Connection) -> None:
    limit(pg, {"t.api": "5/s"})
    store = store_for(db_url)
    try:
        store.insert_many([job("t.api") for _ in range(20)] + [job("t.free") for _ in range(5)])
        consumer = uuid.uuid4()
        rows = store.claim("q", 30, consumer)
        tasks = sorted(r.headers.get("task", "") or "" for r in rows)
        claimed = pg.execute("SELECT task, count(*) FROM pgbroker.jobs WHERE state = 'running'"
                             " GROUP BY task ORDER BY task").fetchall()
        assert claimed == [("t.api", 5), ("t.free", 5)], tasks
        # the 15 beyond the limit wait as 'scheduled', due when a start frees (1 s later)
        waits = pg.execute("SELECT extract(epoch FROM run_at - locked_at_claim) FROM"
                           " (SELECT j.run_at, (SELECT max(locked_at) FROM pgbroker.jobs)"
                           "  AS locked_at_claim FROM pgbroker.jobs AS j"
                           "  WHERE state = 'scheduled') AS s").fetchall()
        assert len(waits) == 15 and all(0.99 <= w[0] <= 1.01 for w in waits), waits
        assert store.claim("q", 30, consumer) == []
        # until they are due by the database's clock (the one promote reads), however long
        # this process took to get here
        wait_for(lambda: pg.execute("SELECT clock_timestamp() >= max(run_at) FROM pgbroker.jobs"
                                    " WHERE state = 'scheduled'").fetchone()[0], 10,
                 interval=0.05, message="the 15 waiting claims to fall due")
        assert store.promote(["q"]) == 15
        assert len(store.claim("q", 30, consumer)) == 5
        assert counts(pg) == {"running": 15, "scheduled": 10}
    finally:
        store.close()


def test_four_consumers_together_keep_the_limit(db_url: str, pg: psycopg.Connection) -> None:
    limit(pg, {"t.api": "20/s"})
    seeder = store_for(db_url)
    seeder.insert_many([job("t.api") for _ in range(120)] + [job("t.free") for _ in range(50)])
    seeder.close()
    errors: list[BaseException] = []
    stop = threading.Event()

    def consume() -> None:
        store: Store = store_for(db_url)
        consumer = uuid.uuid4()
        held: list[tuple[uuid.UUID, int]] = []
        try:
            while not stop.is_set():
                store.promote(["q"])
                locked: list[tuple[uuid.UUID, int]] = []
                rows = store.claim("q", 8, consumer, acks=held, locked=locked)
                later: list[tuple[uuid.UUID, int]] = []  # (as in test_concurrency_keys)
                store.ack(locked, locked=later)
                held = [(r.id, r.attempt) for r in rows] + later
                if not rows:
                    time.sleep(0.02)  # a worker's poll: the next claim a moment later
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            store.ack(held)
            store.close()

    threads = [threading.Thread(target=consume) for _ in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        wait_for(lambda: counts(pg).get("completed", 0) >= 170, 30, interval=0.1,
                 message=lambda: f"the 170 jobs to complete ({counts(pg)})")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    elapsed = time.monotonic() - started
    assert not errors, errors
    assert counts(pg) == {"completed": 170}
    assert pg.execute("SELECT max(attempts) FROM pgbroker.jobs").fetchone() == (1,)
    assert most_claims_in_a_window(pg, "t.api", 1.0) <= 20
    assert elapsed >= 5  # 120 claims at 20/s: at least 5 s (the first 20 at once)
    print(f"\n[figure] 120 rate-limited jobs at 20/s by 4 consumers: {elapsed:.1f} s; busiest "
          f"1 s window {most_claims_in_a_window(pg, 't.api', 1.0)} claims")


def test_the_configured_limits_replace_the_tables(pg: psycopg.Connection) -> None:
    limit(pg, {"a": "1/s", "b": "2/m"})
    pg.execute("UPDATE pgbroker.rate_limits SET starts = ARRAY[now()] WHERE task = 'b'")
    limit(pg, {"b": "3/m", "c": "4/h"})
    rows = pg.execute("SELECT task, max_starts, period_s, rate, cardinality(starts)"
                      " FROM pgbroker.rate_limits ORDER BY task").fetchall()
    # a removed, b changed (its window kept), c added
    assert rows == [("b", 3, 60.0, "3/m", 1), ("c", 4, 3600.0, "4/h", 0)]
    limit(pg, {})
    assert pg.execute("SELECT count(*) FROM pgbroker.rate_limits").fetchone() == (0,)


@pytest.mark.parametrize("configured", [True, False])
def test_a_consumer_writes_its_option_when_it_registers(db_url: str, pg: psycopg.Connection,
                                                        configured: bool) -> None:
    limit(pg, {"old": "1/s"})
    options = {"rate_limits": {"t.api": "10/m"}} if configured else {}
    store = store_for(db_url, **options)
    lease = Lease(store, lambda: ["q"])
    try:
        lease.ensure()
    finally:
        lease.close()
        store.close()
    tasks = [r[0] for r in pg.execute("SELECT task FROM pgbroker.rate_limits")]
    assert tasks == (["t.api"] if configured else ["old"])
