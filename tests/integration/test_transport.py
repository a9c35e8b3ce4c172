"""The pgbroker transport driven through kombu (no Celery worker), and its Store and Sweeper,
against a real, freshly migrated PostgreSQL database per test.

Every outcome is read from the ``jobs`` table; every time comparison uses the database clock.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import kombu
import psycopg
import pytest
from psycopg import ClientCursor

import pgbroker._celery.startup
from pgbroker._model.claimed import after_params
from pgbroker._pg.catalogue import queries
from pgbroker._pg.store import Store
from pgbroker.errors import IdempotencyKeyRequired, MessageError
from pgbroker.sweeper import Sweeper, lock_class
from pgbroker.transport import MAX_NAME_LENGTH
from tests.support.processes import wait_for
from tests.support.transport import (
    NO_POLL,
    Collector,
    age_consumer,
    connect,
    counts,
    db_now,
    drain_until,
    free_port,
    jobs,
    new_job,
    publish,
    store_for,
)

SECRET = "s3cr3t-pw"


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = store_for(db_url)
    yield s
    s.close()


def register(store: Store, queues: list[str], lock_key: int | None = None) -> uuid.UUID:
    """A new consumer registered with a fresh heartbeat (as a Lease does); returns its id."""
    consumer = uuid.uuid4()
    store.register_consumer(consumer, queues, lock_key)
    return consumer


# -- publish / consume ----------------------------------------------------------------------------

def test_publish_consume_round_trip(broker_url: str, pg: psycopg.Connection) -> None:
    body = {"hello": "wörld", "n": [1, 2.5, None]}
    with connect(broker_url) as conn:
        publish(conn, body, "round", headers={"h": "v"}, correlation_id="c-1",
                reply_to="answers")
        [row] = jobs(pg)
        assert (row["queue"], row["state"], row["attempts"], row["task"]) == \
            ("round", "pending", 0, None)
        assert json.loads(bytes(row["body"])) == body

        [(got, message)] = Collector(conn, ["round"]).take(1)
        assert got == body
        assert message.headers["h"] == "v"
        assert message.content_type == "application/json"
        assert message.properties["correlation_id"] == "c-1"
        assert message.properties["reply_to"] == "answers"
        assert message.delivery_info["routing_key"] == "round"
        assert message.delivery_info["redelivered"] is False
        assert jobs(pg)[0]["state"] == "running"

        message.ack()
        [row] = jobs(pg)
        assert (row["state"], row["attempts"]) == ("completed", 1)


QUEUE_NAMES = {
    "quotes": "it's a \"quoted\" queue",
    "sql": "q'); DROP TABLE pgbroker.jobs; --",
    "placeholders": "%(queue)s {schema} $1 %s",
    "unicode": "очередь-é-队列-🚀",
    "255": "n" * 254 + "é",
    "1000": "m" * (MAX_NAME_LENGTH - 1) + "z",
}


@pytest.mark.parametrize("name", QUEUE_NAMES.values(), ids=QUEUE_NAMES.keys())
def test_queue_names_are_data_stored_and_matched_exactly(broker_url: str, pg: psycopg.Connection,
                                                         name: str) -> None:
    near_miss = name[:-1] + ("y" if name[-1] != "y" else "x")  # same length, last char differs
    with connect(broker_url) as conn:
        kombu.Queue(name)(conn.default_channel).declare()
        publish(conn, {"to": "name"}, name)
        publish(conn, {"to": "near miss"}, near_miss)
        assert [r["queue"] for r in jobs(pg)] == [name, near_miss]
        assert pg.execute("SELECT name FROM pgbroker.queues WHERE name = %s",
                          (name,)).fetchone() == (name,)

        collector = Collector(conn, [name], ack=True)
        collector.take(1)
        assert collector.nothing_for(0.3)
        assert collector.bodies == [{"to": "name"}]
    assert [r["state"] for r in jobs(pg)] == ["completed", "pending"]


@pytest.mark.parametrize("name", ["nul\x00byte", "q" * (MAX_NAME_LENGTH + 1)],
                         ids=["nul", "1001"])
def test_invalid_queue_names_are_refused_and_nothing_is_inserted(
        broker_url: str, pg: psycopg.Connection, name: str) -> None:
    with connect(broker_url) as conn:
        with pytest.raises(MessageError, match="queue name"):
            publish(conn, {"n": 1}, name)
        with pytest.raises(MessageError, match="queue name"):
            kombu.Queue(name)(conn.default_channel).declare()
        with pytest.raises(MessageError, match="queue name"):
            Collector(conn, [name])
    assert jobs(pg) == []
    assert pg.execute("SELECT count(*) FROM pgbroker.queues").fetchone() == (0,)


def test_publishing_with_no_routing_key_to_the_default_exchange_is_refused(
        broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        with pytest.raises(MessageError, match="queue name must be a non-empty string"):
            publish(conn, {"n": 1}, "")
    assert jobs(pg) == []


def test_message_over_max_message_size_is_refused(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url, max_message_size=1024) as conn:
        with pytest.raises(MessageError, match="1025 bytes; the limit .* is 1024"):
            publish(conn, b"x" * 1025, "big", content_type="application/octet-stream",
                    content_encoding="binary")
        assert jobs(pg) == []
        publish(conn, b"x" * 1024, "big", content_type="application/octet-stream",
                content_encoding="binary")
    [row] = jobs(pg)
    assert bytes(row["body"]) == b"x" * 1024


def test_a_message_larger_than_the_socket_buffers_goes_through_intact(
        broker_url: str, pg: psycopg.Connection) -> None:
    """Statements are sent on a non-blocking connection: what does not fit in the socket's
    buffers at once must still be sent (and not hang waiting for a reply)."""
    body = bytes(range(256)) * (12 * 1024 * 1024 // 256)  # 12 MB, every byte value
    with connect(broker_url) as conn:
        publish(conn, body, "huge", content_type="application/data", content_encoding="binary")
        [(received, message)] = Collector(conn, ["huge"], ack=True).take(1)
    assert received == body and message.body == body
    assert [r["state"] for r in jobs(pg)] == ["completed"]


@pytest.mark.parametrize(("headers", "match"), [
    ({"max_attempts": 0}, "max_attempts header must be a positive integer"),
    ({"max_attempts": "3"}, "max_attempts header must be a positive integer"),
    ({"max_attempts": True}, "max_attempts header must be a positive integer"),
    ({"eta": "tomorrow"}, "eta header 'tomorrow' is not an ISO 8601 time"),
    ({"expires": "soon"}, "expires header 'soon' is not an ISO 8601 time"),
    ({"eta": ["2026-01-01"]}, "eta header must be an ISO 8601 time"),
])
def test_bad_headers_are_refused_and_nothing_is_inserted(broker_url: str, pg: psycopg.Connection,
                                                         headers: dict[str, Any],
                                                         match: str) -> None:
    with connect(broker_url) as conn:
        with pytest.raises(MessageError, match=match):
            publish(conn, {"n": 1}, "bad", headers=headers)
    assert jobs(pg) == []


def test_a_task_that_requires_an_idempotency_key(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url, require_idempotency_key=["t.charge"]) as conn:
        with pytest.raises(IdempotencyKeyRequired, match="'t.charge' requires an idempotency key"):
            publish(conn, 1, "keys", headers={"task": "t.charge", "id": "a"})
        assert jobs(pg) == []
        publish(conn, 2, "keys", headers={"task": "t.charge", "id": "b", "idempotency_key": "k"})
        publish(conn, 3, "keys", headers={"task": "t.other", "id": "c"})
        # Celery's retry of a keyed task carries its custom headers, the key too, and
        # retries > 0: it continues the same job (the key is not its unique key) ...
        publish(conn, 4, "keys", headers={"task": "t.charge", "id": "b", "retries": 1,
                                          "idempotency_key": "k"})
        # ... and a "retry" without the key is no retry of Celery's: refused like the rest
        with pytest.raises(IdempotencyKeyRequired):
            publish(conn, 5, "keys", headers={"task": "t.charge", "id": "d", "retries": 1})
    assert [r["task_id"] for r in jobs(pg)] == ["b", "c", "b"]


@pytest.mark.parametrize("prefetch", [1, None], ids=["one-by-one", "batch"])
def test_priority_higher_runs_first(broker_url: str, pg: psycopg.Connection,
                                    prefetch: int | None) -> None:
    sent = [("a", 0), ("b", 9), ("c", 5), ("d", 9), ("e", 3), ("f", 300), ("g", -5)]
    with connect(broker_url) as conn:
        for name, priority in sent:
            publish(conn, name, "prio", priority=priority)
        stored = {json.loads(bytes(r["body"])): r["priority"] for r in jobs(pg)}
        assert stored == {"a": 0, "b": 9, "c": 5, "d": 9, "e": 3, "f": 255, "g": 0}
        collector = Collector(conn, ["prio"], ack=True, prefetch_count=prefetch)
        collector.take(len(sent))
    # AMQP direction (higher first), then first in, first out
    assert collector.bodies == ["f", "b", "d", "c", "e", "a", "g"]


def test_eta_waits_as_scheduled_and_is_delivered_when_due(broker_url: str,
                                                          pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        collector = Collector(conn, ["later"])
        eta = db_now(pg) + timedelta(seconds=1.5)
        publish(conn, {"n": 1}, "later", headers={"eta": eta.isoformat()})
        [row] = jobs(pg)
        assert row["state"] == "scheduled"
        assert row["run_at"] == eta

        [(body, message)] = collector.take(1)
        [row] = jobs(pg)
        # claimed by the database clock no earlier than due (locked_at is the claim's now())
        assert row["state"] == "running"
        assert row["locked_at"] >= row["run_at"] == eta
        assert body == {"n": 1}
        message.ack()
        print(f"eta delivery lag (database clock): {row['locked_at'] - eta}")


def test_expires_in_the_past_is_never_delivered_and_swept_expired(
        broker_url: str, db_url: str, pg: psycopg.Connection, store: Store) -> None:
    past = db_now(pg) - timedelta(seconds=10)
    with connect(broker_url) as conn:
        publish(conn, {"n": 1}, "exp", headers={"expires": past.isoformat()})
        [row] = jobs(pg)
        assert (row["state"], row["expires_at"]) == ("pending", past)
        assert Collector(conn, ["exp"]).nothing_for(0.5)
        [row] = jobs(pg)
        assert (row["state"], row["attempts"]) == ("pending", 0)

        assert Sweeper(store).run_once().expired == 1
        [row] = jobs(pg)
        assert (row["state"], row["attempts"]) == ("expired", 0)
        assert row["last_error"] == "expired before delivery"


def test_an_expired_message_does_not_hide_the_next_one(broker_url: str,
                                                       pg: psycopg.Connection) -> None:
    past = db_now(pg) - timedelta(seconds=10)
    with connect(broker_url) as conn:
        publish(conn, {"n": "expired"}, "exphead", headers={"expires": past.isoformat()})
        publish(conn, {"n": "valid"}, "exphead")
        message = conn.default_channel.basic_get("exphead")
        assert message is not None and message.payload == {"n": "valid"}


def test_per_message_expiration_property(broker_url: str, pg: psycopg.Connection,
                                         store: Store) -> None:
    with connect(broker_url) as conn:
        publish(conn, "ttl-60s", "ttl", expiration=60)
        [row] = jobs(pg)
        assert timedelta(seconds=50) < row["expires_at"] - row["created_at"] <= \
            timedelta(seconds=60)
        # Celery's expires header and an AMQP expiration together: the earlier one wins
        soon = db_now(pg) + timedelta(seconds=30)
        publish(conn, "both", "ttl", expiration=600, headers={"expires": soon.isoformat()})
        assert jobs(pg, "body = %s", (b'"both"',))[0]["expires_at"] == soon

        publish(conn, "ttl-0.2s", "ttl", expiration=0.2)
        [short] = jobs(pg, "body = %s", (b'"ttl-0.2s"',))
        wait_for(lambda: db_now(pg) > short["expires_at"], timeout=30)
        collector = Collector(conn, ["ttl"], ack=True)
        collector.take(2)
        assert collector.nothing_for(0.3)
        assert sorted(collector.bodies) == ["both", "ttl-60s"]
    assert Sweeper(store).run_once().expired == 1
    assert jobs(pg, "id = %s", (short["id"],))[0]["state"] == "expired"


@pytest.mark.parametrize("bad", ["soon", [1]])
def test_unparsable_expiration_is_refused(broker_url: str, pg: psycopg.Connection,
                                          bad: Any) -> None:
    with connect(broker_url) as conn:
        channel = conn.default_channel
        message = channel.prepare_message(b"{}", properties={"expiration": bad})
        with pytest.raises(MessageError, match="expiration"):
            channel.basic_publish(message, "", "q")
    assert jobs(pg) == []


# -- reject, requeue, recover ---------------------------------------------------------------------

def test_reject_with_requeue_updates_the_same_row_and_flags_redelivery(
        broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        publish(conn, {"n": 1}, "rq")
        [before] = jobs(pg)
        collector = Collector(conn, ["rq"])
        [(_, first)] = collector.take(1)
        assert first.delivery_info["redelivered"] is False
        first.reject(requeue=True)
        [row] = jobs(pg)
        assert (row["id"], row["state"], row["attempts"]) == (before["id"], "pending", 1)

        [(_, second)] = collector.take(1)
        assert second.delivery_info["redelivered"] is True
        assert second.delivery_tag != first.delivery_tag
        second.ack()
    [row] = jobs(pg)
    assert (row["id"], row["state"], row["attempts"]) == (before["id"], "completed", 2)


def test_reject_without_requeue_goes_dead_with_the_reason(broker_url: str,
                                                          pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        publish(conn, {"n": 1}, "rj")
        [(_, message)] = Collector(conn, ["rj"]).take(1)
        message.reject(requeue=False)
    [row] = jobs(pg)
    assert row["state"] == "dead"
    assert "rejected" in row["last_error"]


def test_requeues_past_max_attempts_go_dead(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url, max_attempts=3) as conn:
        publish(conn, {"n": 1}, "loop")
        collector = Collector(conn, ["loop"])
        for attempt in (1, 2, 3):
            [(_, message)] = collector.take(1)
            assert jobs(pg)[0]["attempts"] == attempt
            message.requeue()
        assert collector.nothing_for(0.3)
    [row] = jobs(pg)
    assert (row["state"], row["attempts"], row["max_attempts"]) == ("dead", 3, 3)
    assert "max attempts (3)" in row["last_error"]


@pytest.mark.parametrize("close", ["channel", "connection"])
def test_closing_with_unacked_messages_restores_the_same_rows(
        broker_url: str, pg: psycopg.Connection, close: str) -> None:
    with connect(broker_url) as conn:
        for n in range(3):
            publish(conn, n, "unacked")
        ids = [r["id"] for r in jobs(pg)]
        channel = conn.channel()
        Collector(conn, ["unacked"], channel=channel).take(3)
        assert {r["state"] for r in jobs(pg)} == {"running"}
        if close == "channel":
            channel.close()
        else:
            conn.close()
        rows = jobs(pg)
        assert [r["id"] for r in rows] == ids
        assert {(r["state"], r["attempts"]) for r in rows} == {("pending", 1)}

    with connect(broker_url) as conn:
        again = Collector(conn, ["unacked"], ack=True).take(3)
        assert {m.delivery_info["redelivered"] for _, m in again} == {True}
    assert {(r["state"], r["attempts"]) for r in jobs(pg)} == {("completed", 2)}


def test_basic_recover_requeues_unacked_deliveries(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        publish(conn, 1, "recover")
        publish(conn, 2, "recover")
        collector = Collector(conn, ["recover"])
        old = [m for _, m in collector.take(2)]
        with pytest.raises(NotImplementedError):
            conn.default_channel.basic_recover(requeue=False)
        conn.default_channel.basic_recover(requeue=True)
        assert {(r["state"], r["attempts"]) for r in jobs(pg)} == {("pending", 1)}
        for message in old:  # acks of the recovered deliveries change nothing
            message.ack()
        assert {r["state"] for r in jobs(pg)} == {"pending"}
        again = collector.take(2)
        assert {m.delivery_info["redelivered"] for _, m in again} == {True}


@pytest.mark.parametrize("event", ["publish", "requeue", "recover", "eta"])
def test_a_notification_wakes_a_consumer_without_polling(broker_url: str, pg: psycopg.Connection,
                                                         event: str) -> None:
    with connect(broker_url, **NO_POLL) as conn:
        collector = Collector(conn, ["wake"])
        if event in ("requeue", "recover"):
            publish(conn, {"n": 1}, "wake")
            [(_, message)] = collector.take(1)  # delivered at once: no idle drain yet
            if event == "requeue":
                message.requeue()
            else:
                conn.default_channel.basic_recover(requeue=True)
        elif event == "eta":
            publish(conn, {"n": 1}, "wake",
                    headers={"eta": (db_now(pg) + timedelta(seconds=0.5)).isoformat()})
        else:
            publish(conn, {"n": 1}, "wake")
        collector.take(1, timeout=15)


def test_drain_events_writes_the_acks_of_a_claimed_batch_together(
        broker_url: str, pg: psycopg.Connection) -> None:
    """Outside an event loop, one ``drain_events`` call hands over everything one claim
    returned; the acks made in its callbacks go out together, in one statement, once the last
    one was handed over. An ack made outside ``drain_events`` is written at once."""
    with connect(broker_url) as conn:
        for n in range(5):
            publish(conn, n, "batch")
        seen: list[Any] = []

        def ack_and_look(body: Any, message: kombu.Message) -> None:
            if body != "late":
                message.ack()
            seen.append((body, message, counts(pg)))

        with kombu.Consumer(conn.default_channel, [kombu.Queue("batch")], accept=["json"],
                            callbacks=[ack_and_look], prefetch_count=5):
            conn.drain_events(timeout=10)
            assert [body for body, _, _ in seen] == list(range(5))
            assert [states for _, _, states in seen] == [{"running": 5}] * 5
            assert counts(pg) == {"completed": 5}

            publish(conn, "late", "batch")
            drain_until(conn, lambda: len(seen) == 6)
            seen[-1][1].ack()
            assert counts(pg) == {"completed": 6}


def test_drain_events_wakes_to_write_an_ack_that_met_a_row_lock(
        broker_url: str, db_url: str, pg: psycopg.Connection) -> None:
    """Outside an event loop, an ack that met another session's row lock is tried again every
    second by the ``drain_events`` waiting meanwhile, as the worker's loop does: not only when
    the wait ends (at the next poll, an hour here, a notification or the call's timeout)."""
    locker = psycopg.connect(db_url)
    try:
        with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
            publish(conn, "locked", "held")
            collector = Collector(conn, ["held"])
            [(_, message)] = collector.take(1)
            # the server ends the locker's session, and its lock, while the drain below waits
            locker.execute("SET idle_in_transaction_session_timeout = '5s'")
            locker.execute("SELECT 1 FROM pgbroker.jobs WHERE queue = 'held' FOR UPDATE")
            message.ack()  # skips the locked row: kept, to be tried again
            assert counts(pg) == {"running": 1}
            drain = threading.Thread(target=conn.drain_events, kwargs={"timeout": 120})
            drain.start()
            try:
                wait_for(lambda: counts(pg) == {"completed": 1}, 30,
                         message=lambda: f"the ack written while the drain waits ({counts(pg)})")
            finally:
                publish(producer, "wake", "held")  # the drain delivers it and returns
                drain.join(60)
            assert collector.bodies == ["locked", "wake"]
    finally:
        locker.close()


# -- delivery identity and the sweeper ------------------------------------------------------------

def test_late_ack_of_an_old_delivery_changes_nothing(store: Store, pg: psycopg.Connection) -> None:
    store.insert(new_job("late", {"n": 1}))
    first = register(store, ["late"])
    [old] = store.claim("late", 1, first)
    pg.execute("DELETE FROM pgbroker.consumers WHERE id = %s", (first,))  # the worker is gone
    assert Sweeper(store).run_once().rescued == 1

    second = register(store, ["late"])
    [new] = store.claim("late", 1, second)
    assert (new.id, old.attempt, new.attempt) == (old.id, 1, 2)

    assert store.ack([(old.id, old.attempt)]) == 0  # the paused worker wakes up and acks
    [row] = jobs(pg)
    assert (row["state"], row["attempts"], row["locked_by"]) == ("running", 2, second)
    store.requeue([(old.id, old.attempt)])  # nor can it requeue or bury the new delivery
    assert store.bury(old.id, old.attempt, "stale") == 0
    assert jobs(pg)[0]["state"] == "running"

    assert store.ack([(new.id, new.attempt)]) == 1
    assert jobs(pg)[0]["state"] == "completed"


def test_sweeper_never_resurrects_a_completed_job(store: Store, pg: psycopg.Connection) -> None:
    store.insert(new_job("done", {"n": 1}))
    consumer = register(store, ["done"])
    [job] = store.claim("done", 1, consumer)
    assert store.ack([(job.id, job.attempt)]) == 1
    age_consumer(pg, consumer, 3600)
    result = Sweeper(store).run_once()
    assert (result.rescued, result.buried, result.consumers) == (0, 0, 1)
    [row] = jobs(pg)
    assert (row["state"], row["attempts"]) == ("completed", 1)


def test_sweeper_skips_a_job_whose_ack_is_in_flight(store: Store, db_url: str,
                                                    pg: psycopg.Connection) -> None:
    store.insert(new_job("inflight", {"n": 1}))
    consumer = register(store, ["inflight"])
    [job] = store.claim("inflight", 1, consumer)
    age_consumer(pg, consumer, 3600)  # looks gone, but its ack is being committed right now
    with psycopg.connect(db_url) as acker:  # a transaction: the ack holds the row lock
        acker.execute(queries("pgbroker")["job_ack"], {"ids": [job.id], "attempts": [job.attempt]})
        result = Sweeper(store).run_once()  # must neither block nor overwrite
        assert (result.rescued, result.buried) == (0, 0)
        acker.commit()
    assert Sweeper(store).run_once().rescued == 0
    [row] = jobs(pg)
    assert (row["state"], row["attempts"]) == ("completed", 1)


def test_sweeper_rescues_a_consumer_whose_advisory_lock_is_gone(
        store: Store, db_url: str, pg: psycopg.Connection) -> None:
    key, consumer = 424242, uuid.uuid4()
    worker = psycopg.connect(db_url, autocommit=True)  # the consumer's own session: it takes
    worker.execute("SELECT pg_advisory_lock(%s, %s)", (lock_class("pgbroker"), key))  # the lock
    worker.execute(queries("pgbroker")["consumer_register"], {  # and registers, as a Lease does
        "id": consumer, "host": "elsewhere", "pid": 1, "queues": ["lock"], "lock_key": key,
        "lease": 20})
    store.insert(new_job("lock", {"n": 1}))
    [job] = store.claim("lock", 1, consumer)
    sweeper = Sweeper(store)
    assert sweeper.run_once().rescued == 0  # alive: lock held, fresh heartbeat

    worker.close()  # the worker's connection dies; its heartbeat is still fresh
    wait_for(lambda: sweeper.run_once().rescued, timeout=30, message="the rescue")
    [row] = jobs(pg)
    assert (row["id"], row["state"], row["attempts"], row["locked_by"]) == \
        (job.id, "pending", 1, None)
    assert "consumer lost" in row["last_error"]
    assert pg.execute("SELECT count(*) FROM pgbroker.consumers").fetchone() == (0,)


@pytest.mark.parametrize("max_attempts", [5, 1])
def test_sweeper_rescues_a_consumer_with_an_old_heartbeat(store: Store, pg: psycopg.Connection,
                                                          max_attempts: int) -> None:
    consumer = register(store, ["hb"])  # no advisory lock: heartbeats are the guarantee
    store.insert(new_job("hb", {"n": 1}, max_attempts=max_attempts))
    store.claim("hb", 1, consumer)
    sweeper = Sweeper(store)
    now, lease = db_now(pg), timedelta(seconds=store.settings.lease_timeout)
    assert sweeper.run_once(now=now + lease / 2).rescued == 0
    result = sweeper.run_once(now=now + lease + timedelta(seconds=1))
    [row] = jobs(pg)
    if max_attempts == 1:  # its one attempt was spent by the lost consumer
        assert (result.rescued, result.buried, row["state"]) == (0, 1, "dead")
        assert "max attempts (1) reached" in row["last_error"]
    else:
        assert (result.rescued, result.buried, row["state"]) == (1, 0, "pending")
    assert result.consumers == 1


def test_a_living_consumer_is_never_rescued(broker_url: str, db_url: str, pg: psycopg.Connection,
                                            store: Store) -> None:
    with connect(broker_url) as conn:  # a real lease: registered, advisory lock, heartbeats
        publish(conn, {"n": 1}, "long")
        Collector(conn, ["long"]).take(1)
        [row] = jobs(pg)
        # the task has been running for a day: only the consumer's liveness matters
        pg.execute("UPDATE pgbroker.jobs SET locked_at = now() - interval '1 day'")
        [consumer] = pg.execute("SELECT id, lock_key FROM pgbroker.consumers").fetchall()
        assert consumer[0] == row["locked_by"] and consumer[1] is not None
        for _ in range(3):
            result = Sweeper(store).run_once()
            assert (result.rescued, result.buried, result.consumers) == (0, 0, 0)
        assert jobs(pg)[0]["state"] == "running"


def test_a_worker_says_once_when_nothing_vacuums_the_jobs_table(
        broker_url: str, pg: psycopg.Connection, store: Store, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def warnings_from(calls: int) -> int:
        monkeypatch.setattr(pgbroker._celery.startup, "_warned", set())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pgbroker"):
            for _ in range(calls):
                pgbroker._celery.startup.warn_without_autovacuum(store)  # at worker_ready
        return sum("autovacuum is off for pgbroker.jobs" in r.getMessage()
                   for r in caplog.records)

    pg.execute("ALTER TABLE pgbroker.jobs_live SET (autovacuum_enabled = false)")
    pg.commit()
    assert not store.autovacuum_on()
    assert warnings_from(2) == 1
    # a consumer that is no Celery worker (celery inspect's, say) does not say it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pgbroker"), connect(broker_url) as conn:
        conn.ensure_connection()
        conn.transport.lease.ensure()
    assert "autovacuum" not in caplog.text

    pg.execute("ALTER TABLE pgbroker.jobs_live RESET (autovacuum_enabled)")
    pg.commit()
    server_on = pg.execute("SELECT current_setting('autovacuum')::boolean "
                           "AND current_setting('track_counts')::boolean").fetchone()[0]
    assert store.autovacuum_on() is server_on  # this machine's server runs without autovacuum
    assert warnings_from(2) == (0 if server_on else 1)


# -- retention ------------------------------------------------------------------------------------

def test_retention_prunes_old_finished_rows_in_batches(db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url, retention=60, prune_batch_size=100)
    try:
        store.insert_many([new_job("ret", n) for n in range(270)])
        pg.execute("""
            WITH numbered AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM pgbroker.jobs)
            UPDATE pgbroker.jobs AS j SET
                state = CASE WHEN n <= 250 THEN 'completed' WHEN n <= 255 THEN 'expired'
                             WHEN n <= 260 THEN 'dead' ELSE j.state END,
                updated_at = CASE WHEN n <= 260 THEN now() - interval '2 minutes'
                                  ELSE j.updated_at END
            FROM numbered WHERE j.id = numbered.id""")
        pg.execute("UPDATE pgbroker.jobs SET state = 'completed' WHERE id IN "
                   "(SELECT id FROM pgbroker.jobs WHERE state = 'pending' LIMIT 5)")  # recent
        assert counts(pg) == {"completed": 255, "expired": 5, "dead": 5, "pending": 5}

        assert store.prune() == 100  # one batch per statement
        assert Sweeper(store).run_once(prune_batches=1).pruned == 100
        assert Sweeper(store).run_once().pruned == 55
        assert Sweeper(store).run_once().pruned == 0
        # recent completed rows stay for the window; dead letters and pending jobs are never pruned
        assert counts(pg) == {"completed": 5, "dead": 5, "pending": 5}
    finally:
        store.close()


def test_retention_zero_deletes_on_ack(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url, retention=0) as conn:
        publish(conn, "acked", "zero")
        publish(conn, "rejected", "zero")
        collector = Collector(conn, ["zero"], prefetch_count=1)
        [(_, acked)] = collector.take(1)
        acked.ack()
        [(_, rejected)] = collector.take(1)
        rejected.reject(requeue=False)
    [row] = jobs(pg)  # the dead letter is kept
    assert (bytes(row["body"]), row["state"]) == (b'"rejected"', "dead")


# -- idempotency and dedupe -----------------------------------------------------------------------

def test_same_task_and_idempotency_key_make_one_row(broker_url: str,
                                                    pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        for task_id, task, key in [("a", "t.charge", "order-1"), ("b", "t.charge", "order-1"),
                                   ("c", "t.refund", "order-1"), ("d", "t.charge", "order-2")]:
            publish(conn, task_id, "idem",
                    headers={"task": task, "id": task_id, "idempotency_key": key})
    rows = jobs(pg)
    assert [(r["task_id"], r["task"], r["idempotency_key"]) for r in rows] == [
        ("a", "t.charge", "order-1"), ("c", "t.refund", "order-1"), ("d", "t.charge", "order-2")]


def test_the_same_message_twice_makes_one_row(broker_url: str, pg: psycopg.Connection) -> None:
    def celery_like(task_id: str, retries: int, nesting: int = 0) -> dict[str, Any]:
        return {"task": "t.add", "id": task_id, "retries": retries, "lang": "py",
                "replaced_task_nesting": nesting}

    with connect(broker_url) as conn:
        publish(conn, [[1, 2], {}, {}], "dedupe", headers=celery_like("tid-1", 0))
        publish(conn, [[1, 2], {}, {}], "dedupe", headers=celery_like("tid-1", 0))  # a retry
        assert len(jobs(pg)) == 1
        publish(conn, [[1, 2], {}, {}], "dedupe", headers=celery_like("tid-1", 1))  # self.retry()
        publish(conn, [[3], {}, {}], "dedupe", headers=celery_like("tid-1", 0, 1))  # replace()
        publish(conn, [[1, 2], {}, {}], "other", headers=celery_like("tid-1", 0))  # 2nd queue
    assert [(r["queue"], r["task_id"], r["retries"]) for r in jobs(pg)] == [
        ("dedupe", "tid-1", 0), ("dedupe", "tid-1", 1), ("dedupe", "tid-1", 0),
        ("other", "tid-1", 0)]


# -- concurrency ----------------------------------------------------------------------------------

def test_two_consumers_never_receive_the_same_message(broker_url: str, db_url: str,
                                                      pg: psycopg.Connection) -> None:
    total = 2000
    loader = store_for(db_url)
    try:
        for start in range(0, total, 500):
            loader.insert_many([new_job("race", n) for n in range(start, start + 500)])
    finally:
        loader.close()
    received: list[list[int]] = [[], []]
    errors: list[BaseException] = []
    stop = threading.Event()

    def consume(mine: list[int]) -> None:
        try:
            with connect(broker_url) as conn:
                def on_message(body: int, message: kombu.Message) -> None:
                    mine.append(body)
                    message.ack()

                with kombu.Consumer(conn, [kombu.Queue("race")], callbacks=[on_message],
                                    prefetch_count=10):
                    deadline = time.monotonic() + 120
                    while not stop.is_set() and time.monotonic() < deadline:
                        try:
                            conn.drain_events(timeout=0.2)
                        except TimeoutError:
                            pass
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=consume, args=(mine,)) for mine in received]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: sum(map(len, received)) >= total or errors, timeout=120,
                 interval=0.1, message=lambda: f"{sum(map(len, received))} of {total} received")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    elapsed = time.monotonic() - started
    assert not errors, errors
    both = received[0] + received[1]
    duplicates = [n for n, c in Counter(both).items() if c > 1]
    assert duplicates == []
    assert sorted(both) == list(range(total))
    assert set(received[0]).isdisjoint(received[1])
    assert counts(pg) == {"completed": total}
    assert pg.execute("SELECT max(attempts) FROM pgbroker.jobs").fetchone() == (1,)
    print(f"concurrent claim: {len(received[0])} + {len(received[1])} messages in "
          f"{elapsed:.1f}s ({total / elapsed:.0f} msg/s, prefetch 10, ack each)")


# -- bad rows -------------------------------------------------------------------------------------

def test_undecodable_body_goes_dead_with_the_reason(broker_url: str, store: Store,
                                                    pg: psycopg.Connection) -> None:
    bad = new_job("undecodable", None)
    store.insert(bad)
    pg.execute("UPDATE pgbroker.jobs SET body = %s WHERE id = %s", (b"\xff{not json", bad.id))
    store.insert(new_job("undecodable", "next"))
    decode_errors: list[Exception] = []

    def on_decode_error(message: kombu.Message, exc: Exception) -> None:
        decode_errors.append(exc)
        message.ack()  # what Celery's consumer does, so that the message does not loop

    with connect(broker_url) as conn:
        collector = Collector(conn, ["undecodable"], ack=True, on_decode_error=on_decode_error)
        drain_until(conn, lambda: decode_errors and collector.received, what="both messages")
    assert collector.bodies == ["next"]
    row = jobs(pg, "id = %s", (bad.id,))[0]
    assert row["state"] == "dead"
    assert "undecodable" in row["last_error"]
    assert "application/json" in row["last_error"]


@pytest.mark.parametrize(("column", "value"), [
    ("headers", "[1, 2]"), ("headers", '"text"'), ("properties", "[1, 2]"), ("properties", "3"),
])
def test_malformed_row_goes_dead_and_the_consumer_keeps_going(
        broker_url: str, store: Store, pg: psycopg.Connection, column: str, value: str) -> None:
    bad = new_job("malformed", None)
    store.insert(bad)
    pg.execute(f"UPDATE pgbroker.jobs SET {column} = %s::jsonb WHERE id = %s", (value, bad.id))
    store.insert(new_job("malformed", "next"))
    with connect(broker_url) as conn:
        assert Collector(conn, ["malformed"], ack=True).take(1)[0][0] == "next"
    row = jobs(pg, "id = %s", (bad.id,))[0]
    assert row["state"] == "dead"
    assert "malformed job row" in row["last_error"]
    assert column in row["last_error"]


# -- connections ----------------------------------------------------------------------------------

def test_as_uri_masks_the_password_of_a_live_connection(db_url: str) -> None:
    parts = urlsplit(db_url)
    secret = parts.password or SECRET  # the server trusts local users: any password will do
    if not parts.password:
        parts = parts._replace(netloc=f"{parts.username or 'postgres'}:{secret}@"
                                      f"{parts.netloc.rpartition('@')[2]}")
    with connect("pgbroker+" + urlunsplit(parts)) as conn:
        conn.connect()
        assert conn.connected
        assert secret not in conn.as_uri()
        assert conn.as_uri().startswith("pgbroker+postgresql://")
        # the password is kombu's password field (kombu formats a "+" URL from the hostname,
        # which Celery prints in inspect stats: it keeps "**")
        assert conn.password == secret and secret not in conn.as_uri(include_password=True)


@pytest.mark.parametrize("form", ["kombu-failover", "libpq-multi-host"])
def test_a_dead_first_host_fails_over_to_the_live_one(db_url: str, pg: psycopg.Connection,
                                                      form: str) -> None:
    parts = urlsplit(db_url)
    dead, live = f"127.0.0.1:{free_port()}", f"{parts.hostname}:{parts.port or 5432}"
    user = parts.username or "postgres"
    url = (f"pgbroker://{user}@{dead}{parts.path};pgbroker://{user}@{live}{parts.path}"
           if form == "kombu-failover" else
           f"pgbroker+postgresql://{user}@{dead},{live}{parts.path}"
           "?target_session_attrs=read-write")
    with kombu.Connection(url, transport_options={"connect_timeout": 5}) as conn:
        conn.ensure_connection(max_retries=3, interval_start=0, interval_step=0)
        assert conn.connected
        if form == "kombu-failover":
            assert (conn.transport_cls, conn.port) == ("pgbroker", parts.port or 5432)
        publish(conn, "over", "failover")
        assert Collector(conn, ["failover"], ack=True).take(1)[0][0] == "over"
    assert counts(pg) == {"completed": 1}


def test_publish_with_retry_survives_a_dropped_connection(broker_url: str, db_url: str,
                                                          pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        producer = kombu.Producer(conn.default_channel)
        producer.publish(1, routing_key="drop", serializer="json")
        pg.execute("SELECT pg_terminate_backend(%s)",
                   (conn.transport.store.conn.info.backend_pid,))
        with pytest.raises(conn.connection_errors):  # no retry: a clear connection error
            producer.publish(2, routing_key="drop", serializer="json")
        producer.publish(3, routing_key="drop", serializer="json", retry=True)  # kombu reconnects
    assert [bytes(r["body"]) for r in jobs(pg)] == [b"1", b"3"]


def _publish_from_child(conn: kombu.Connection) -> None:
    kombu.Producer(conn.default_channel).publish("child", routing_key="fork", serializer="json")


def test_a_forked_child_never_uses_its_parents_session(broker_url: str,
                                                       pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        publish(conn, "parent-1", "fork")
        backend = conn.transport.store.conn.info.backend_pid
        child = multiprocessing.get_context("fork").Process(target=_publish_from_child,
                                                            args=(conn,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        publish(conn, "parent-2", "fork")  # the parent's session is intact...
        assert conn.transport.store.conn.info.backend_pid == backend
    # ...and the child published over a session of its own (ids from two processes are not
    # ordered: uuid6.uuid7 runs ahead of the clock after a burst, and the child copied its state)
    assert sorted(bytes(r["body"]) for r in jobs(pg)) == [b'"child"', b'"parent-1"',
                                                          b'"parent-2"']


# -- the claim's plan -----------------------------------------------------------------------------

@pytest.mark.parametrize("acks", [0, 20], ids=["no-acks", "with-acks"])
def test_claim_query_plan_uses_the_partial_index(pg: psycopg.Connection, acks: int) -> None:
    pg.execute("""
        INSERT INTO pgbroker.jobs (id, queue, body, state, priority)
        SELECT gen_random_uuid(), 'q' || (i % 5), '\\x00', 'pending', i % 3
        FROM generate_series(1, 5500) AS i""")
    pg.execute("""
        INSERT INTO pgbroker.jobs (id, queue, body, state, attempts, updated_at)
        SELECT gen_random_uuid(), 'q' || (i % 5), '\\x00', 'completed', 1, now()
        FROM generate_series(1, 20000) AS i""")
    # ~500 jobs running elsewhere; the claim also carries the acks deferred since the previous
    # one (job id, attempt) of this consumer's finished deliveries
    running = [r[0] for r in pg.execute(
        "UPDATE pgbroker.jobs SET state = 'running', attempts = 1, locked_by = gen_random_uuid()"
        " WHERE id IN (SELECT id FROM pgbroker.jobs WHERE state = 'pending' LIMIT 500)"
        " RETURNING id")][:acks]
    pg.execute("ANALYZE pgbroker.jobs")
    query = queries("pgbroker")["job_claim"]
    values = {"queue": "q1", "limit": 10, "consumer": uuid.uuid4(), "ids": running,
              "attempts": [1] * len(running), **after_params()}
    params = {name: values[name] for name in re.findall(r"%\((\w+)\)s", query)}
    with ClientCursor(pg) as cur:
        rows = cur.execute("EXPLAIN " + query, params).fetchall()
    plan = "\n".join(r[0] for r in rows)
    print(plan)
    assert "jobs_claim_idx" in plan
    assert "Seq Scan on jobs" not in plan
