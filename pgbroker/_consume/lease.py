"""A consumer's lease: registration, advisory lock, heartbeats, and the in-worker sweeper.

One :class:`Lease` per consuming broker connection. It registers the consumer (after taking its
session advisory lock, so no sweeper can see the row without the lock), then a daemon thread
heartbeats every ``heartbeat_interval`` and sweeps every ``sweep_interval``, over the process's
shared store (:func:`pgbroker._pg.process_store.acquire`; never the event loop's LISTEN connection):
a blocked event loop (a solo pool running a long task) does not stop the heartbeats, and a stopped
process (SIGSTOP) or a dead host does. The lock lives on that shared connection: when anyone
reconnects it, the lease takes its lock again on the new session before it is used, and tells
its consumer (``on_reconnect``): after a failover whose old primary went dark, the heartbeats
are what notices first, and the consumer's LISTEN connection may be left on the old server.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from .._model.rate_limits import RateLimit
from .._pg.catalogue import Queries
from .._pg.process_store import acquire, release
from .._pg.store import Store
from ..metrics import is_internal_queue
from ..sweeper import Sweeper, lock_class

__all__ = ["Lease"]

logger = logging.getLogger(__name__)


class Lease:
    """Registration and liveness of one consumer id."""

    def __init__(self, store: Store, queues: Callable[[], Sequence[str]],
                 on_reconnect: Callable[[], None] | None = None):
        self.id = uuid.uuid4()
        self._on_reconnect = on_reconnect
        self.settings = store.settings
        self._queues = queues
        # The process's shared store (not the event loop's LISTEN connection), one more user
        self._store = acquire(store.conninfo, store.settings)
        self._store.on_connect.append(self._relock)
        self._lock_class = lock_class(self.settings.schema)
        self._lock_key: int | None = None
        self._q = Queries(self.settings.schema)
        self._sweeper = Sweeper(self._store)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._locked_on: psycopg.Connection[Any] | None = None  # the session holding our lock
        self._moved = False  # the lock key changed at a reconnect: register it at the next beat
        self._mutex = threading.Lock()
        #: (seconds its settling statements have failed for, the last error), or (None, None):
        #: written with each heartbeat (the consumer's Settler.status)
        self.settle_status: Callable[[], tuple[float | None, str | None]] = lambda: (None, None)

    def ensure(self, refresh: bool = False) -> uuid.UUID:
        """Register (once) and start heartbeating; returns the consumer id to claim with.
        ``refresh``: the consumed queues changed, write them now rather than at the next beat
        (a queue with x-expires must never look unconsumed)."""
        if self._started:
            if refresh:
                self._store.heartbeat(self.id, self._queues(), *self.settle_status())
            return self.id
        if not self._started:
            with self._mutex:
                if not self._started:
                    self._register()
                    self._thread = threading.Thread(
                        target=self._run, name=f"pgbroker-lease-{self.id}", daemon=True)
                    self._thread.start()
                    self._started = True
        return self.id

    def _register(self) -> None:
        # Under the store's statement lock: the connection is the process's, and a statement
        # of another thread (a publish) interleaved with ours made libpq refuse one ("another
        # command is already in progress") or hand one thread the other's result, leaving it
        # to wait for ever on the socket (a `celery inspect` hung in consumer_lock_try).
        with self._store.statement_lock():
            conn = self._store.connect()
            if self.settings.use_advisory_locks and not self.settings.transaction_pooling \
                    and conn is not self._locked_on:  # (a reconnect's _relock took it already)
                self._lock_key = self._take_lock(conn)
                self._locked_on = conn
            self._store.register_consumer(self.id, self._queues(), self._lock_key)
            if self.settings.rate_limits is not None:
                write_rate_limits(conn, self.settings.schema, self.settings.rate_limits)

    def _relock(self, conn: psycopg.Connection[Any]) -> None:
        """The shared store has a new session: take this consumer's lock again on it (the old
        session's went with it), before any statement runs there (no other thread has it yet,
        so no statement lock is needed). Another key if it is taken (vanishingly rare): the
        next beat registers it. Then the consumer hears of it."""
        if self._on_reconnect is not None:
            self._on_reconnect()
        if self._lock_key is None or not self._started:
            return
        key = self._take_lock(conn)
        self._locked_on = conn
        if key != self._lock_key:
            self._lock_key, self._moved = key, True

    def _take_lock(self, conn: psycopg.Connection[Any]) -> int:
        if self._lock_key is not None and self._try_lock(conn, self._lock_key):
            return self._lock_key
        while True:  # a random key; another consumer holding the same one is vanishingly rare
            key = random.randint(1, 0x7FFFFFFF)
            if self._try_lock(conn, key):
                return key

    def _try_lock(self, conn: psycopg.Connection[Any], key: int) -> bool:
        row = self._q.one(conn, "consumer_lock_try", {"class": self._lock_class, "key": key},
                          what="taking the consumer lock")
        return bool(row and row[0])

    def _run(self) -> None:
        next_sweep = time.monotonic() + random.uniform(0, self.settings.sweep_interval)
        backoff = 0.5
        while not self._stop.wait(self.settings.heartbeat_interval):
            try:
                if self._moved:
                    self._moved = False
                    self._register()
                if not self._store.heartbeat(self.id, self._queues(), *self.settle_status()):
                    logger.warning(
                        "pgbroker consumer %s was declared lost (no heartbeat for %ss); its "
                        "running jobs were redelivered: registering again", self.id,
                        self.settings.lease_timeout)
                    self._register()
                if time.monotonic() >= next_sweep and self.settings.sweep_interval > 0:
                    next_sweep = time.monotonic() + self.settings.sweep_interval
                    # A remote-control client (celery inspect, status: reply queues only)
                    # sweeps, but neither warns of a held horizon nor vacuums: it lives a
                    # second, and its stderr is the user's terminal.
                    worker = not all(map(is_internal_queue, self._queues()))
                    self._sweeper.horizon.enabled = self._sweeper.vacuum.enabled = worker
                    self._sweeper.run_once()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - keep the lease alive through database restarts
                logger.warning("pgbroker lease %s: %s; reconnecting", self.id, exc)
                self._store.close()
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, self.settings.heartbeat_interval)
                try:
                    self._register()
                except Exception as exc2:  # noqa: BLE001 - retried at the next beat
                    logger.warning("pgbroker lease %s: cannot register again: %s", self.id, exc2)

    def close(self) -> None:
        """Stop heartbeating, unregister and let the lock go (the shared connection stays)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(ValueError):
            self._store.on_connect.remove(self._relock)
        if self._started:
            try:
                with self._store.statement_lock():  # (see _register)
                    self._store.unregister_consumer(self.id)
                    if self._lock_key is not None:
                        self._q.one(self._store.conn, "consumer_unlock",
                                    {"class": self._lock_class, "key": self._lock_key})
            except Exception as exc:  # noqa: BLE001 - the sweeper forgets us anyway
                logger.debug("pgbroker lease %s: unregister failed: %s", self.id, exc)
        release(self._store)


def write_rate_limits(conn: psycopg.Connection[Any], schema: str,
                      limits: tuple[RateLimit, ...]) -> None:
    """Make ``rate_limits`` hold exactly ``limits`` (a changed limit keeps its window)."""
    Queries(schema).execute(conn, "rate_limits_set", {
        "tasks": [limit.task for limit in limits],
        "max_starts": [limit.max_starts for limit in limits],
        "periods": [limit.period for limit in limits],
        "rates": [limit.rate for limit in limits],
    })
