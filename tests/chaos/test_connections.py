"""How many PostgreSQL connections pgbroker holds, read from ``pg_stat_activity``.

A worker host multiplies these: 200 hosts of one worker each need 200 x (connections per
worker) server connections. A worker holds two (issue 20, point 3; four before): the process's
shared store (publishes, acks outside the loop, the lease's heartbeats, sweeps and advisory lock)
and the event loop's LISTEN connection, with the same crash guarantees (the lock vanishes with a
dead worker's session, heartbeats stop with a frozen one); a web process's producer side holds
one, whatever number of threads publish.
"""

from __future__ import annotations

import threading

import psycopg

import pgbroker
from tests.apps import e2e_app as e2e
from tests.support.workers import start_worker
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import wait_for


def _pgbroker_sessions(pg: psycopg.Connection) -> list[str]:
    """The application names of pgbroker's sessions in this database (not the test's own)."""
    return sorted(r[0] for r in pg.execute(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'pgbroker%%' AND pid <> pg_backend_pid()"))


def test_an_idle_worker_holds_at_most_two_connections(runs: psycopg.Connection,
                                                      broker_url: str) -> None:
    worker = start_worker(broker_url, "-c", "4")
    # the lease and the listener start with the consumer: wait for the lease's registration
    wait_for(lambda: runs.execute("SELECT count(*) FROM pgbroker.consumers").fetchone()[0], 30,
             message="the worker's consumer registration")
    sessions = wait_for(lambda: _pgbroker_sessions(runs), 10)
    print(f"\n[figure] an idle worker -c 4 holds {len(sessions)} connections: {sessions}")
    assert worker.is_alive()
    assert len(sessions) <= 2, sessions


def test_a_web_process_producer_opens_one_connection(runs: psycopg.Connection,
                                                     broker_url: str) -> None:
    """A web process: requests publish from 4 threads at once, repeatedly."""
    point_producer(e2e.app, broker_url)
    try:
        def requests(n: int) -> None:
            for i in range(25):
                e2e.touch.delay(f"web-{n}-{i}")

        threads = [threading.Thread(target=requests, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        sessions = _pgbroker_sessions(runs)
    finally:
        drop_pools(e2e.app)
    print(f"\n[figure] a producer publishing from 4 threads holds {len(sessions)} "
          f"connection(s): {sessions}")
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 100
    assert len(sessions) == 1, sessions


def test_enqueue_uses_the_callers_connection(runs: psycopg.Connection, db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        for i in range(10):
            pgbroker.enqueue(conn, e2e.touch, (f"enq-{i}",), app=e2e.app)
        conn.commit()
        assert _pgbroker_sessions(runs) == []
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 10
