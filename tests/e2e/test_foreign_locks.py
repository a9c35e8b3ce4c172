"""Row locks held by other sessions (issue 18, point 3), with real ``celery worker`` processes.

Any role that may write pgbroker's tables (an operator in psql, a careless script) can hold a
row lock in a transaction it leaves open. Such a lock must never make a living worker look lost
(its long task would run twice: the README promises it never does), never hold up its
heartbeat, its sweeper, a publish or its other deliveries; the one statement that needs the
locked row waits, or is retried later, alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import kombu
import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.e2e import hostile_app as h
from tests.support.workers import SHORT_LEASE, job, key_runs, start_worker, wait_done, wait_state
from tests.support.processes import wait_for


@contextlib.contextmanager
def held(db_url: str, statement: str, params: Any = None) -> Iterator[psycopg.Connection]:
    """``statement`` run in a transaction of another session, left open (its row locks held)
    until the block ends, then rolled back."""
    with psycopg.connect(db_url) as conn:
        conn.execute(statement, params)
        try:
            yield conn
        finally:
            conn.rollback()


def heartbeat_ages(pg: psycopg.Connection) -> list[float]:
    return [r[0] for r in pg.execute(
        "SELECT extract(epoch FROM now() - heartbeat_at)::float8 FROM pgbroker.consumers")]


def test_a_lock_on_the_queue_row_holds_up_no_heartbeat_and_runs_no_long_task_twice(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    # two workers: each sweeps, and the other would take a redelivery
    a, b = (start_worker(broker_url, "-c", "1", options=SHORT_LEASE, app=h.__name__)
            for _ in range(2))
    nap = h.long_nap.delay("long", 9)
    wait_for(lambda: key_runs(runs, "long"), 30, message="the long task to start")
    hold = 2 * SHORT_LEASE["lease_timeout"]
    with held(db_url, "UPDATE pgbroker.queues SET paused = paused WHERE name = 'celery'"):
        # a producer that connects now and declares its queue first, as kombu's
        # publish(declare=[...]) does: its publish must not wait
        published: list[str] = []

        def publish() -> None:
            with kombu.Connection(broker_url) as conn:
                kombu.Producer(conn.default_channel).publish(
                    {"n": 1}, routing_key="celery", declare=[kombu.Queue("celery")],
                    serializer="json", headers={"task": "tests.apps.e2e_app.touch", "id": "fresh"})
            published.append("fresh")

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        thread.join(hold)
        time.sleep(max(0.0, hold - 1))  # the lock outlives the lease
        ages = heartbeat_ages(runs)
        assert published, "a publish waited for the lock on the queue row"
        assert job(runs, "fresh")  # stored
        assert len(ages) == 2 and max(ages) < SHORT_LEASE["lease_timeout"], ages
    wait_done(runs, ["long"], 60)
    assert len(key_runs(runs, "long")) == 1, key_runs(runs, "long")
    assert job(runs, nap.id)["attempts"] == 1
    assert a.is_alive() and b.is_alive()


def test_a_lock_on_a_finished_jobs_row_stalls_no_other_delivery(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    start_worker(broker_url, "-c", "2", app=h.__name__)
    first = e2e.nap.delay("locked", 1)
    wait_state(runs, first.id, "running")
    with held(db_url, "SELECT 1 FROM pgbroker.jobs WHERE task_id = %s FOR UPDATE", (first.id,)):
        wait_for(lambda: key_runs(runs, "locked:done"), 30, message="the locked job to finish")
        later = [e2e.touch.delay(f"later-{i}") for i in range(3)]
        for result in later:  # its ack meets the lock; the worker's other work goes on
            wait_state(runs, result.id, "completed", timeout=20)
        assert job(runs, first.id)["state"] == "running"  # its ack is retried, not lost ...
    wait_state(runs, first.id, "completed", timeout=30)  # ... and written once the lock goes
    assert len(key_runs(runs, "locked")) == 1
