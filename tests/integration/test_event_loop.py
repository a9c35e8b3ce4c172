"""The transport inside an event loop (kombu's Hub, as a Celery worker runs it).

There, claims and acks go out on the LISTEN connection without the loop waiting for them: these
tests hold a claim in flight with a table lock taken from another session and check that the loop
goes on meanwhile, that nothing is delivered twice or lost, and what happens to the rows of a
claim still in flight when the consumer closes.
"""

from __future__ import annotations

import fcntl
import struct
import termios
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.support.transport import (
    NO_POLL,
    LoopConsumer,
    connect,
    counts,
    jobs,
    publish,
)
from tests.support.processes import wait_for


@pytest.fixture
def locker(db_url: str) -> Iterator[psycopg.Connection]:
    """A session that can hold a lock on the jobs table (claims wait behind it)."""
    with psycopg.connect(db_url) as conn:
        yield conn
        conn.rollback()


def unread_bytes(fd: int) -> int:
    """How many bytes wait unread on socket ``fd``."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def wait_for_bytes(fd: int, more_than: int, timeout: float = 10.0) -> int:
    """Wait until more than ``more_than`` bytes wait unread on socket ``fd``; returns how many."""
    return wait_for(lambda: (unread := unread_bytes(fd)) > more_than and unread, timeout,
                    interval=0.01, message=lambda: f"more than {more_than} bytes unread on the "
                    f"socket (still {unread_bytes(fd)})")


def lock_jobs(conn: psycopg.Connection) -> None:
    conn.execute("LOCK TABLE pgbroker.jobs IN EXCLUSIVE MODE")


def test_every_message_once_with_acks_folded_into_claims(broker_url: str,
                                                         pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        for n in range(300):
            publish(conn, n, "loop")
    with connect(broker_url, **NO_POLL) as conn:
        consumer = LoopConsumer(conn, "loop", prefetch=4)
        consumer.run_until(lambda: len(consumer.received) == 300)
        # the last acks go out with the next turn's statement
        consumer.run_until(lambda: counts(pg).get("completed") == 300)
        consumer.hub.close()
    assert sorted(m.payload for m in consumer.received) == list(range(300))
    assert {(r["state"], r["attempts"]) for r in jobs(pg)} == {("completed", 1)}


def test_the_loop_goes_on_while_a_claim_waits(broker_url: str, pg: psycopg.Connection,
                                              locker: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        publish(conn, "first", "busy")
    with connect(broker_url, **NO_POLL) as conn:
        consumer = LoopConsumer(conn, "busy", prefetch=1)  # claims are sent by the loop
        lock_jobs(locker)
        ticks: list[float] = []
        consumer.hub.call_repeatedly(0.01, lambda: ticks.append(time.monotonic()))
        consumer.run_until(lambda: len(ticks) >= 20, timeout=10)  # the claim is still waiting
        assert consumer.received == []
        assert conn.transport.in_flight is not None
        locker.rollback()  # the claim goes through
        consumer.run_until(lambda: len(consumer.received) == 1)
        assert consumer.received[0].payload == "first"
        consumer.hub.close()


def test_a_publish_during_a_claim_in_flight_is_not_missed(broker_url: str,
                                                          pg: psycopg.Connection,
                                                          locker: psycopg.Connection) -> None:
    """The claim in flight may not see a job committed meanwhile; its NOTIFY must still lead to
    another claim (no poll fallback here)."""
    with connect(broker_url) as conn:
        publish(conn, "before", "race")
    with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
        consumer = LoopConsumer(conn, "race", prefetch=10)
        lock_jobs(locker)
        consumer.run_until(lambda: conn.transport.in_flight is not None)
        locker.rollback()
        publish(producer, "during", "race")
        consumer.run_until(lambda: len(consumer.received) == 2, timeout=15)
        assert sorted(m.payload for m in consumer.received) == ["before", "during"]
        consumer.hub.close()


def test_closing_with_a_claim_in_flight_gives_its_rows_back(broker_url: str,
                                                            pg: psycopg.Connection,
                                                            locker: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        for n in range(3):
            publish(conn, n, "closing")
    conn = connect(broker_url, **NO_POLL)
    consumer = LoopConsumer(conn, "closing", prefetch=10)
    lock_jobs(locker)
    consumer.run_until(lambda: conn.transport.in_flight is not None)
    threading.Timer(0.3, locker.rollback).start()  # the claim finishes while close waits on it
    conn.close()
    assert consumer.received == []
    assert {(r["state"], r["attempts"]) for r in jobs(pg)} == {("pending", 1)}
    consumer.hub.close()

    with connect(broker_url, **NO_POLL) as again:
        second = LoopConsumer(again, "closing", prefetch=10)
        second.run_until(lambda: len(second.received) == 3)
        assert {m.delivery_info["redelivered"] for m in second.received} == {True}
        second.hub.close()


def test_a_claim_that_fails_on_a_living_connection_waits_and_claims_again(
        broker_url: str, pg: psycopg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    """A claim in flight that fails while its connection lives (a statement timeout behind a
    table lock here; a full disk alike) is no lost connection: nothing is raised into the loop
    (Celery would restart the consumer, which claims new jobs it cannot settle either), claims
    wait and are sent again, and the message is claimed once the lock is gone (issue 27)."""
    with connect(broker_url) as conn:
        publish(conn, "x", "failing")
    with connect(broker_url, **NO_POLL) as conn:
        consumer = LoopConsumer(conn, "failing", prefetch=1)
        conn.transport.consumer.listen().execute("SET statement_timeout = 50")
        pg.execute("BEGIN")
        pg.execute("LOCK TABLE pgbroker.jobs IN EXCLUSIVE MODE")
        try:
            consumer.run_until(lambda: "a claim failed on a living connection" in caplog.text,
                               timeout=10)
            assert "SQLSTATE 57014" in caplog.text
        finally:
            pg.execute("ROLLBACK")
        consumer.run_until(lambda: len(consumer.received) == 1)
        consumer.hub.close()
    assert {(r["state"], r["attempts"]) for r in jobs(pg)} == {("completed", 1)}


def test_a_notify_read_with_a_statements_result_wakes_the_loop(broker_url: str,
                                                               pg: psycopg.Connection) -> None:
    """A NOTIFY that comes in the same read as the result of the statement in flight: libpq
    parses it only while that result is taken, after the notifications were read; it must still
    lead to a claim, not wait for the poll (none here). An idle worker acking its last task as
    the next one is published met this now and then: that task came up to a poll_interval late."""
    with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
        consumer = LoopConsumer(conn, "idle", prefetch=10)
        consumer.run_until(lambda: conn.transport.in_flight is not None)  # finds nothing
        listener = conn.transport.consumer.listen().fileno()
        # the loop is not turned: its result comes into the socket, unread, then the NOTIFY
        result = wait_for_bytes(listener, 0)
        publish(producer, "late", "idle")
        wait_for_bytes(listener, result)
        consumer.run_until(lambda: len(consumer.received) == 1, timeout=5)
        assert consumer.received[0].payload == "late"
        consumer.hub.close()


def test_a_claim_result_that_arrives_in_many_reads_is_taken(broker_url: str,
                                                           pg: psycopg.Connection) -> None:
    """A claim's result larger than one read of the socket: the loop read the NOTIFYs again
    after finding the result unfinished, and that read took the result's last bytes into
    libpq's buffer, leaving the socket quiet; the finished claim then waited there for a poll
    (none here), its rows running and undelivered. Half of the workers that claimed a 25 KB
    batch hung like that."""
    body = "x" * 20_000
    with connect(broker_url) as conn:
        for n in range(400):
            publish(conn, [n, body], "big")
    with connect(broker_url, **NO_POLL) as conn:
        consumer = LoopConsumer(conn, "big", prefetch=40)  # claims of ~800 KB each
        consumer.run_until(lambda: len(consumer.received) == 400, timeout=60)
        consumer.hub.close()
    assert sorted(m.payload[0] for m in consumer.received) == list(range(400))


def test_the_poll_takes_a_result_whose_bytes_were_read_outside_the_loop(
        broker_url: str, pg: psycopg.Connection) -> None:
    """Whatever reads the socket outside the readable callback, a finished claim never waits
    forever in libpq's buffer: the poll takes it (the loop sends no claim before it is taken)."""
    with connect(broker_url) as conn:
        publish(conn, "stranded", "strand")
    with connect(broker_url, poll_interval=0.2) as conn:
        consumer = LoopConsumer(conn, "strand", prefetch=10)
        consumer.run_until(lambda: conn.transport.in_flight is not None)
        listener = conn.transport.consumer.listen()
        wait_for_bytes(listener.fileno(), 0)

        def whole_result_buffered() -> bool:
            """Read the socket into libpq's buffer, outside the loop, until the claim's whole
            result is there (libpq then says a PQgetResult would not block)."""
            listener.pgconn.consume_input()
            return not listener.pgconn.is_busy()

        # the socket is quiet again, the result in libpq's buffer only
        wait_for(whole_result_buffered, 10, interval=0.01, message="the claim's whole result")
        consumer.run_until(lambda: len(consumer.received) == 1, timeout=10)
        assert consumer.received[0].payload == "stranded"
        consumer.hub.close()
