"""Acks, requeues and burials that met another session's row lock, tried again later.

Any role that may update ``jobs`` (an operator in psql, a script) can hold a delivery's row
locked in a transaction it leaves open. The statements that settle deliveries (``job_ack``,
``job_ack_delete``, ``job_requeue``, ``job_bury``) skip such a row and say so; a consumer keeps
what they skipped here and settles it again every :data:`RETRY` seconds, so one locked row holds
up that delivery alone, never the consumer's other acks and claims.
"""

from __future__ import annotations

import logging
import uuid
from time import monotonic

from ._messages import REQUEUED
from ._store import Store

__all__ = ["RETRY", "Settler"]

logger = logging.getLogger(__name__)

#: Seconds between tries of an ack, requeue or burial whose row another session holds locked.
RETRY = 1.0

Delivery = tuple[uuid.UUID, int]


class Settler:
    """``settler(op, deliveries, error)`` runs ``op`` ("ack", "ack_delete", "requeue" or
    "bury") now and keeps what met a lock in :attr:`pending`, for :meth:`retry`."""

    def __init__(self, store: Store):
        self.store = store
        self.pending: list[tuple[str, Delivery, str | None]] = []
        self.tried_at = monotonic()

    def __call__(self, op: str, deliveries: list[Delivery], error: str | None = None,
                 again: bool = False) -> None:
        locked: list[Delivery] = []
        if op == "requeue":
            # Celery's reject(requeue=True) gives no reason: REQUEUED says what it means in a
            # worker, a lost pool process (or a task's Reject(requeue=True), counted alike)
            self.store.requeue(deliveries, error, locked, lost=error == REQUEUED)
        elif op == "bury":
            for job_id, attempt in deliveries:
                self.store.bury(job_id, attempt, error or "", locked)
        else:
            self.store.ack(deliveries, delete=op == "ack_delete", locked=locked)
        self.keep(op, locked, error, again)

    def keep(self, op: str, deliveries: list[Delivery], error: str | None = None,
             again: bool = False) -> None:
        """Settle these later (they met a row lock)."""
        if deliveries and not again:
            logger.info("pgbroker: %d %s(s) wait for a row lock another session holds; tried "
                        "again every %ss", len(deliveries), op, RETRY)
        self.pending.extend((op, delivery, error) for delivery in deliveries)

    @property
    def due(self) -> bool:
        return bool(self.pending) and monotonic() - self.tried_at >= RETRY

    def retry(self) -> None:
        """Try everything pending once more (grouped: one statement per operation)."""
        self.tried_at = monotonic()
        todo, self.pending = self.pending, []
        batches: dict[tuple[str, str | None], list[Delivery]] = {}
        for op, delivery, error in todo:
            batches.setdefault((op, error), []).append(delivery)
        for (op, error), deliveries in batches.items():
            self(op, deliveries, error, again=True)
