"""Acks, requeues and burials that met another session's row lock, or whose statement failed on
a living connection, tried again later.

Any role that may update ``jobs`` (an operator in psql, a script) can hold a delivery's row
locked in a transaction it leaves open. The statements that settle deliveries (``job_ack``,
``job_ack_delete``, ``job_requeue``, ``job_bury``) skip such a row and say so; a consumer keeps
what they skipped here and settles it again every :data:`RETRY` seconds, so one locked row holds
up that delivery alone, never the consumer's other acks and claims.

A settling statement can also fail while the connection lives: a full disk (53100), a statement
or lock timeout set on the database, a trigger. That is no lost connection: the consumer is not
restarted (which would claim new jobs it cannot settle either, and leave these 'running' under a
consumer that no longer exists, to be run again as lost); their rows stay 'running' under this
living consumer, and they are tried again every :data:`RETRY` seconds, with a WARNING naming the
jobs and the SQLSTATE (again every :data:`WARN_EVERY` seconds while it lasts).
"""

from __future__ import annotations

import logging
import uuid
from time import monotonic

import psycopg

from .._pg import driver as _db
from .._pg.store import Store

__all__ = ["RETRY", "Settler"]

logger = logging.getLogger(__name__)

#: Seconds between tries of an ack, requeue or burial whose row another session holds locked.
RETRY = 1.0
#: Seconds between WARNINGs while settling statements keep failing.
WARN_EVERY = 30.0

Delivery = tuple[uuid.UUID, int]


class Settler:
    """``settler(op, deliveries, error)`` runs ``op`` ("ack", "ack_delete", "requeue" or
    "bury") now and keeps what met a lock in :attr:`pending`, for :meth:`retry`."""

    def __init__(self, store: Store):
        self.store = store
        self.pending: list[tuple[str, Delivery, str | None]] = []
        #: settling statements that failed in a row (on a living connection), and the WARNING
        self.failures = 0
        self._warned_at = 0.0
        self._failing_since: float | None = None  # monotonic, while they fail
        self._error: str | None = None

    def __call__(self, op: str, deliveries: list[Delivery], error: str | None = None,
                 again: bool = False) -> None:
        locked: list[Delivery] = []
        try:
            if op == "requeue":
                self.store.requeue(deliveries, error, locked)
            elif op == "bury":
                for n, (job_id, attempt) in enumerate(deliveries):
                    try:
                        self.store.bury(job_id, attempt, error or "", locked)
                    except psycopg.Error:
                        deliveries = deliveries[n:]  # (the ones before it are made)
                        raise
            else:
                self.store.ack(deliveries, delete=op == "ack_delete", locked=locked)
        except psycopg.Error as exc:
            if _db.lost_connection(exc):
                raise
            self.failed(op, deliveries, error, exc)
            return
        self.keep(op, locked, error, again)

    def failed(self, op: str, deliveries: list[Delivery], error: str | None,
               exc: psycopg.Error) -> None:
        """``op`` on ``deliveries`` failed on a living connection: kept, tried again, said."""
        self.failures += 1
        self.pending.extend((op, delivery, error) for delivery in deliveries)
        if self._failing_since is None:
            self._failing_since = monotonic()
        self._error = f"SQLSTATE {exc.sqlstate}: {_db.first_line(exc)} ({op} of {len(deliveries)})"
        if monotonic() - self._warned_at >= WARN_EVERY:
            self._warned_at = monotonic()
            logger.warning(
                "pgbroker: %s of %d job(s) failed on a living connection (SQLSTATE %s: %s): "
                "their rows stay 'running' under this worker, tried again every %ss (%d failed "
                "statement(s) so far); first jobs: %s", op, len(deliveries), exc.sqlstate,
                _db.first_line(exc),
                RETRY, self.failures, ", ".join(str(d[0]) for d in deliveries[:5]))

    def keep(self, op: str, deliveries: list[Delivery], error: str | None = None,
             again: bool = False) -> None:
        """Settle these later (they met a row lock)."""
        if deliveries and not again:
            logger.info("pgbroker: %d %s(s) wait for a row lock another session holds, or "
                        "their statement failed; tried again every %ss", len(deliveries), op,
                        RETRY)
        self.pending.extend((op, delivery, error) for delivery in deliveries)

    def retry(self) -> None:
        """Try everything pending once more (grouped: one statement per operation)."""
        todo, self.pending = self.pending, []
        batches: dict[tuple[str, str | None], list[Delivery]] = {}
        for op, delivery, error in todo:
            batches.setdefault((op, error), []).append(delivery)
        failures = self.failures
        for (op, error), deliveries in batches.items():
            self(op, deliveries, error, again=True)
        if failures and self.failures == failures:
            logger.warning("pgbroker: delivery updates are written again, after %d failed "
                           "statement(s)", failures)
            self.failures, self._failing_since, self._error = 0, None, None

    def status(self) -> tuple[float | None, str | None]:
        """(seconds its settling statements have failed for, the last error): (None, None)
        while they are written (the lease writes it with each heartbeat)."""
        if self._failing_since is None:
            return None, None
        return monotonic() - self._failing_since, self._error
