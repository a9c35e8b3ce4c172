"""Connections over a multi-host URL with ``target_session_attrs=read-write``: the server that
took a process's last connection is tried first by the next (``pgbroker._pg.driver.connect``), and a
connection left on another server is given up (``_db.superseded``), with the acks of the event
loop's claim in flight made on the new server. The scenario it is for, an old primary whose
address went dark, is tests/chaos/test_blackholed_primary.py; here a real server and a closed port
stand for the promoted primary and the old one.
"""

from __future__ import annotations

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pgbroker._pg import driver as _db
from pgbroker._pg.store import Store
from pgbroker.settings import Settings
from tests.support.transport import NO_POLL, LoopConsumer, connect, jobs, publish
from tests.support.db import free_port
from tests.support.processes import wait_for


def test_the_next_connection_goes_to_the_server_that_took_the_last_one(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    given = conninfo_to_dict(db_url)
    host, port = given.get("host") or "127.0.0.1", str(given.get("port") or 5432)
    closed = free_port()
    url = (f"postgresql://{given.get('user', 'postgres')}@/{given['dbname']}"
           f"?host=127.0.0.1,{host}&port={closed},{port}&target_session_attrs=read-write")
    monkeypatch.setattr(_db, "_last_good", {})
    with _db.connect(url) as conn:  # the closed port refuses, the server takes it
        assert str(conn.info.port) == port
    assert _db._last_good == {url: (host, port)}
    assert _db._last_good_first(url, conninfo_to_dict(url)) == {
        "host": f"{host},127.0.0.1", "port": f"{port},{closed}"}
    with _db.connect(url) as conn:
        assert str(conn.info.port) == port


def test_a_store_left_on_the_old_primary_connects_again_before_its_next_statement(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another connection of the process found the writable server elsewhere (here: the same
    server under another name, as a failover's new primary would be): the store's connection
    is superseded, and its next statement goes to that server rather than into what may be a
    dark address (tests/chaos/test_blackholed_primary.py)."""
    given = conninfo_to_dict(db_url)
    port = str(given.get("port") or 5432)
    url = (f"postgresql://{given.get('user', 'postgres')}@/{given['dbname']}"
           f"?host=127.0.0.1,localhost&port={port}&target_session_attrs=read-write")
    monkeypatch.setattr(_db, "_last_good", {})
    store = Store(url, Settings())
    try:
        old = store.connect()
        assert old.info.host == "127.0.0.1" and not _db.superseded(old)
        _db._last_good[url] = ("localhost", port)  # what that other connection recorded
        assert _db.superseded(old)
        assert store.queue_size("celery") == 0
        assert old.closed and store.conn.info.host == "localhost"
        assert not _db.superseded(store.conn)
    finally:
        store.close()


def test_a_claim_given_up_on_the_old_primary_makes_its_acks_on_the_new_one(
        db_url: str, pg: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop's claim in flight carries the acks of finished tasks. When its connection
    turns out to be on a failover's old primary, the claim is given up without waiting (that
    address may be dark); its acks are made on the new primary, not left for the lease to
    redeliver their tasks (here the claim failed where it ran: a table lock outlasted it)."""
    given = conninfo_to_dict(db_url)
    port = str(given.get("port") or 5432)
    url = (f"pgbroker+postgresql://{given.get('user', 'postgres')}@/{given['dbname']}"
           f"?host=127.0.0.1,localhost&port={port}&target_session_attrs=read-write")
    monkeypatch.setattr(_db, "_last_good", {})
    with connect(url) as producer:
        publish(producer, "ran", "failover")
    conn = connect(url, **NO_POLL)
    consumer = LoopConsumer(conn, "failover", prefetch=1, ack=False)
    try:
        consumer.run_until(lambda: len(consumer.received) == 1)
        with psycopg.connect(db_url) as locker:
            locker.execute("LOCK TABLE pgbroker.jobs IN EXCLUSIVE MODE")
            consumer.received[0].ack()  # deferred: folded into the next claim
            # that claim waits for the lock, then fails where it runs (lock_timeout)
            consumer.run_until(lambda: conn.transport.in_flight is not None)
            wait_for(lambda: waiting_for_a_lock(pg), 10, message="the claim to wait")
            wait_for(lambda: not waiting_for_a_lock(pg), 10, message="its lock timeout")
        # a failover: another connection of the process found the writable server elsewhere
        for key in list(_db._last_good):
            _db._last_good[key] = ("localhost", port)
        conn.close()
    finally:
        consumer.hub.close()
    assert [(r["state"], r["attempts"]) for r in jobs(pg)] == [("completed", 1)]


def waiting_for_a_lock(pg: psycopg.Connection) -> bool:
    """Whether a session of this database waits for a lock on pgbroker.jobs."""
    return pg.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted"
                      " AND relation IN (SELECT relid FROM pg_partition_tree('pgbroker.jobs')))"
                      ).fetchone()[0]
