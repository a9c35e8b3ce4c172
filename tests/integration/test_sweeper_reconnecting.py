"""The sweeper after a restart or a failover: a consumer whose advisory lock is missing is dead
only if it took that lock on the running server instance (issue 20).

After ``pg_ctl restart`` or a standby's promotion no lock of any consumer is held, yet every
worker is alive and reconnecting; its running jobs come back only if its heartbeat stops for
``lease_timeout`` (tests/chaos/test_failover.py runs the real thing).
"""

from __future__ import annotations

import uuid

import psycopg

from pgbroker.sweeper import Sweeper
from tests.support.db import add_job
from tests.support.transport import store_for


def _consumer(pg: psycopg.Connection, server_started: str) -> uuid.UUID:
    """A consumer that heartbeats (now) and whose lock (key 4242) nobody holds."""
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues, lock_key, server_started)"
               f" VALUES (%s, 'host', 1, '{{q1}}', 4242, {server_started})", (consumer,))
    return consumer


def test_a_missing_lock_means_dead_only_on_the_instance_that_granted_it(
        db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url)
    try:
        here = add_job(pg, "running", locked_by=_consumer(pg, "pg_postmaster_start_time()"))
        before = add_job(pg, "running", locked_by=_consumer(
            pg, "pg_postmaster_start_time() - interval '1 hour'"))  # registered before a restart
        result = Sweeper(store).run_once()
        states = dict(pg.execute("SELECT id, state FROM pgbroker.jobs").fetchall())
    finally:
        store.close()
    assert (result.rescued, result.consumers) == (1, 1)
    assert states == {here: "pending", before: "running"}


def test_registering_again_records_this_instance(db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url)
    try:
        consumer = _consumer(pg, "pg_postmaster_start_time() - interval '1 hour'")
        store.register_consumer(consumer, ["q1"], 77)
        row = pg.execute("SELECT lock_key, server_started = pg_postmaster_start_time()"
                         " FROM pgbroker.consumers WHERE id = %s", (consumer,)).fetchone()
    finally:
        store.close()
    assert row == (77, True)
