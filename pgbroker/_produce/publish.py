"""Where a published kombu message is written: a job, the jobs of a fanout, a broadcast or a
dead letter, by the caller's transaction inside ``pgbroker.transaction(db)``, else by the store.

:class:`Publisher` is the channel's writing side (``Channel._put``, ``_put_fanout``, the topic
exchange's broadcasts and ``_unroutable``'s dead letters); which queues a message goes to is
the channel's routing (:mod:`pgbroker.transport`, :mod:`pgbroker._model.routing`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import uuid6

from .._model.job import NewJob
from .._model.message import message_to_job
from .._pg.store import Store
from ..settings import Settings
from . import revoke as _revoke
from .transaction import current_target

__all__ = ["Publisher", "UNROUTABLE"]

logger = logging.getLogger(__name__)

#: The queue of the dead letters of unroutable messages (see Channel._unroutable).
UNROUTABLE = "pgbroker.unroutable"


class Publisher:
    """Writes one channel's published messages (see the module docstring)."""

    def __init__(self, store: Store, settings: Settings):
        self.store = store
        self.settings = settings

    def job(self, queue: str | None, message: dict[str, Any]) -> NewJob:
        return message_to_job(self.settings, queue, message)

    def put(self, queue: str, message: dict[str, Any]) -> None:
        """A job in ``queue``."""
        job = self.job(queue, message)
        target = current_target(self.store.conninfo)
        # inside pgbroker.transaction(db) (or atomic()): the caller's transaction
        if target is not None:
            target.add(job, self.settings)
        else:
            self.store.insert(job)

    def dead_letter(self, message: dict[str, Any], reason: str) -> None:
        """Keep an unroutable message as a dead letter of :data:`UNROUTABLE` that says why."""
        job = dataclasses.replace(self.job(UNROUTABLE, message), idempotency_key=None)
        target = current_target(self.store.conninfo)
        # inside pgbroker.transaction(db) (or atomic()): the caller's transaction
        if target is not None:
            target.add_dead(job, self.settings, reason)
        else:
            self.store.insert_dead(job, reason)
        logger.warning("pgbroker: %s; kept as a dead letter of queue %r", reason, UNROUTABLE)

    def fanout(self, exchange: str, message: dict[str, Any]) -> None:
        """A message to a fanout exchange, as AMQP routes it: a job in every bound queue
        declared without auto-delete (or exclusive), where it waits until consumed; and a
        broadcast for the auto-delete ones (Celery's mailboxes and ``Broadcast`` queues), which
        exist only while consumed. Nobody bound: nothing is written. A revoke is also written
        to the jobs it names, bound or not (:mod:`pgbroker._produce.revoke`)."""
        job = self.job(None, message)
        revoke = _revoke.request_of(exchange, message)
        if revoke is not None:
            _revoke.apply(self.store, revoke, job, via="celery revoke")
            return
        target = current_target(self.store.conninfo)
        if target is None:
            self.store.fanout(job)  # one statement
            return
        # inside pgbroker.transaction(db): the jobs are written by the caller's transaction
        transient = []
        for queue, stored in self.store.fanout_queues(exchange):
            if stored:
                target.add(dataclasses.replace(job, id=uuid6.uuid7(), queue=queue),
                           self.settings)
            else:
                transient.append(queue)
        if transient:
            self.store.broadcast(job, transient)

    def broadcast(self, message: dict[str, Any]) -> None:
        """A transient message as one broadcast row (and its NOTIFY), read by every process
        consuming a queue its exchange routes it to."""
        self.store.broadcast(self.job(None, message))
