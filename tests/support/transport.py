"""Helpers shared by the kombu-level tests (no Celery worker): the integration and conformance
tiers.

They drive kombu directly against the test's fresh database (``broker_url`` / ``db_url`` / ``pg``
fixtures of tests/conftest.py) and read the outcome from the ``jobs`` table with SQL.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import kombu
from kombu.asynchronous import Hub
import psycopg
import uuid6

import pgbroker  # noqa: F401 - registers pgbroker://
from pgbroker._pg.store import NewJob, Store
from pgbroker.settings import Settings
from tests.support.db import counts, db_now, free_port, jobs

__all__ = ["NO_POLL", "OPTIONS", "Collector", "LoopConsumer", "age_consumer", "connect", "counts",
           "db_now", "drain_until", "free_port", "jobs", "new_job", "publish", "store_for"]

#: Transport options of these tests: no sweep from the lease thread, so that only the test's
#: own ``Sweeper.run_once()`` changes rows behind the consumer's back; a short poll fallback.
OPTIONS: dict[str, Any] = {"sweep_interval": 0, "poll_interval": 1}

#: No poll fallback in practice: a consumer must be woken by NOTIFY (or its due timer) alone.
NO_POLL: dict[str, Any] = {"poll_interval": 3600}


def connect(broker_url: str, **options: Any) -> kombu.Connection:
    """A kombu connection with :data:`OPTIONS` plus ``options`` (not yet connected)."""
    return kombu.Connection(broker_url, transport_options={**OPTIONS, **options})


def store_for(db_url: str, **options: Any) -> Store:
    """A :class:`Store` on ``db_url`` (the caller closes it)."""
    return Store(db_url, Settings(**{**OPTIONS, **options}))


def publish(conn: kombu.Connection, body: Any, queue: str, **kwargs: Any) -> None:
    """Publish ``body`` straight to ``queue`` (the default exchange, routing key = queue name),
    JSON-encoded unless a ``content_type`` says the body is already encoded."""
    if "content_type" not in kwargs:
        kwargs.setdefault("serializer", "json")
    kombu.Producer(conn.default_channel).publish(body, routing_key=queue, **kwargs)


def new_job(queue: str, body: Any = None, **fields: Any) -> NewJob:
    """A JSON job for :meth:`Store.insert` / :meth:`Store.insert_many`."""
    return NewJob(id=uuid6.uuid7(), queue=queue, body=json.dumps(body).encode(),
                  content_type="application/json", content_encoding="utf-8",
                  headers=fields.pop("headers", {}), properties=fields.pop("properties", {}),
                  routing_key=queue, **fields)


def drain_until(conn: kombu.Connection, predicate: Callable[[], Any], timeout: float = 30.0,
                what: str | Callable[[], str] = "the condition") -> None:
    """Drain ``conn``'s events until ``predicate()`` is true.

    Raises:
        AssertionError: ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s draining events for {text}")
        try:
            conn.drain_events(timeout=min(left, 1.0))
        except TimeoutError:
            pass


class Collector:
    """A kombu Consumer on ``queues`` that keeps what it receives (nothing is acked for you)."""

    def __init__(self, conn: kombu.Connection, queues: Iterable[str | kombu.Queue],
                 ack: bool = False, prefetch_count: int | None = None,
                 channel: Any = None, **consumer_kwargs: Any):
        self.conn = conn
        self.ack = ack
        self.received: list[tuple[Any, kombu.Message]] = []
        self.consumer = kombu.Consumer(
            channel if channel is not None else conn.default_channel,
            [q if isinstance(q, kombu.Queue) else kombu.Queue(q) for q in queues],
            callbacks=[self._on_message], accept=["json", "pickle"], **consumer_kwargs)
        if prefetch_count is not None:
            self.consumer.qos(prefetch_count=prefetch_count)
        self.consumer.consume()

    def _on_message(self, body: Any, message: kombu.Message) -> None:
        self.received.append((body, message))
        if self.ack:
            message.ack()

    @property
    def bodies(self) -> list[Any]:
        return [body for body, _ in self.received]

    def take(self, count: int, timeout: float = 30.0) -> list[tuple[Any, kombu.Message]]:
        """Drain events until ``count`` more messages arrived; return them.

        Raises:
            AssertionError: ``timeout`` seconds passed first.
        """
        start = len(self.received)
        drain_until(self.conn, lambda: len(self.received) - start >= count, timeout,
                    what=lambda: f"{count} messages (got {self.bodies[start:]!r})")
        return self.received[start:]

    def nothing_for(self, seconds: float) -> bool:
        """True when no message arrives within ``seconds`` (a bounded wait, never a speed claim)."""
        before = len(self.received)
        try:
            self.conn.drain_events(timeout=seconds)
        except TimeoutError:
            pass
        return len(self.received) == before

    def cancel(self) -> None:
        self.consumer.cancel()


def age_consumer(pg: psycopg.Connection, consumer: uuid.UUID, seconds: float) -> None:
    """Make ``consumer``'s last heartbeat ``seconds`` old (a frozen or cut-off worker)."""
    pg.execute("UPDATE pgbroker.consumers SET heartbeat_at = now() - make_interval(secs => %s)"
               " WHERE id = %s", (seconds, consumer))


class LoopConsumer:
    """A kombu consumer on a Hub; ``run_until`` turns the loop."""

    def __init__(self, conn: kombu.Connection, queue: str, prefetch: int, ack: bool = True):
        conn.ensure_connection()
        self.hub = Hub()
        conn.transport.register_with_event_loop(conn.connection, self.hub)
        self.received: list[kombu.Message] = []
        self.ack = ack
        self.consumer = kombu.Consumer(conn.channel(), [kombu.Queue(queue)],
                                       callbacks=[self._on_message], accept=["json"],
                                       prefetch_count=prefetch)
        self.consumer.consume()
        self.loop = self.hub.create_loop()

    def _on_message(self, body: Any, message: kombu.Message) -> None:
        self.received.append(message)
        if self.ack:
            message.ack()

    def run_until(self, predicate: Any, timeout: float = 30.0) -> int:
        """Turn the loop until ``predicate()``; returns how many turns it took."""
        deadline = time.monotonic() + timeout
        turns = 0
        while not predicate():
            assert time.monotonic() < deadline, "timed out turning the event loop"
            next(self.loop)
            turns += 1
        return turns
