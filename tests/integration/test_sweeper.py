"""One sweeper pass over a state the test builds, at the time the test chooses.

``Sweeper.run_once(now=...)`` measures every horizon (the lease, expiry, due times, retention)
from ``now``, so a test leaves the rows as a crashed worker leaves them and runs one pass later
on the database's clock, without waiting for the lease to run out.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import psycopg

from pgbroker._pg.store import Store
from pgbroker.sweeper import Sweeper, SweepResult
from tests.support.transport import new_job
from tests.support.db import counts, db_now, jobs


def crashed_worker(store: Store, pg: psycopg.Connection, queue: str) -> uuid.UUID:
    """What a SIGKILLed worker leaves: its consumer row (a fresh heartbeat, no session lock:
    heartbeats are the guarantee) and three jobs it had claimed, one on its last attempt."""
    consumer = uuid.uuid4()
    store.register_consumer(consumer, [queue], None)
    store.insert_many([new_job(queue, {"n": 1}), new_job(queue, {"n": 2}),
                       new_job(queue, {"n": 3}, max_attempts=1)])
    assert len(store.claim(queue, 3, consumer)) == 3
    assert counts(pg) == {"running": 3}
    return consumer


def changed(result: SweepResult) -> tuple[int, ...]:
    """What a pass did to jobs and consumers (the per-minute statistics aside: the first pass
    of a minute writes them whatever the clock)."""
    return (result.rescued, result.buried, result.consumers, result.expired, result.promoted,
            result.pruned)


def test_one_pass_after_the_lease_rescues_a_crashed_workers_jobs(
        store: Store, pg: psycopg.Connection) -> None:
    consumer = crashed_worker(store, pg, "crash")
    sweeper = Sweeper(store)
    now, lease = db_now(pg), timedelta(seconds=store.settings.lease_timeout)

    assert changed(sweeper.run_once()) == (0,) * 6  # the heartbeat is fresh: nothing to do yet
    assert changed(sweeper.run_once(now=now + lease - timedelta(seconds=1))) == (0,) * 6

    result = sweeper.run_once(now=now + lease + timedelta(seconds=1))
    assert changed(result) == (2, 1, 1, 0, 0, 0)
    rows = jobs(pg)
    assert [(r["state"], r["attempts"], r["locked_by"]) for r in rows] == \
        [("pending", 1, None), ("pending", 1, None), ("dead", 1, None)]
    assert all("consumer lost" in r["last_error"] for r in rows[:2])
    assert "max attempts (1) reached" in rows[2]["last_error"]
    assert pg.execute("SELECT count(*) FROM pgbroker.consumers WHERE id = %s",
                      (consumer,)).fetchone() == (0,)
    assert changed(sweeper.run_once(now=now + lease + timedelta(seconds=1))) == (0,) * 6


def test_expiry_promotion_and_retention_are_measured_from_the_pass_time(
        store: Store, pg: psycopg.Connection) -> None:
    now = db_now(pg)
    due = new_job("later", {"n": "due"}, run_at=now + timedelta(minutes=10))
    stale = new_job("later", {"n": "stale"}, expires_at=now + timedelta(minutes=5))
    done = new_job("later", {"n": "done"})
    store.insert_many([due, stale, done])
    pg.execute("UPDATE pgbroker.jobs SET state = 'completed' WHERE id = %s", (done.id,))
    sweeper = Sweeper(store)
    assert changed(sweeper.run_once()) == (0,) * 6

    assert changed(sweeper.run_once(now=now + timedelta(minutes=11))) == (0, 0, 0, 1, 1, 0)
    assert {r["id"]: r["state"] for r in jobs(pg)} == \
        {due.id: "pending", stale.id: "expired", done.id: "completed"}
    later = now + timedelta(seconds=store.settings.retention + 3600)
    assert sweeper.run_once(now=later).pruned == 2  # the completed and the expired one
    assert [r["id"] for r in jobs(pg)] == [due.id]
