"""Celery's ``worker_disable_prefetch`` (``celery worker --disable-prefetch``) on pgbroker: a
worker claims jobs only for its free pool processes.

Celery 5.6 applies the setting only when the broker's ``driver_type`` is ``redis``
(``celery.worker.consumer.tasks.Tasks.start``): it wraps the task channel's
``QoS.can_consume`` so that the worker fetches nothing while its reserved requests (received,
running or waiting for a process) are as many as its pool has processes (the autoscaler's
maximum, if any); on any other transport it logs a warning that it ignores the setting. Here the
same gate is put on pgbroker's task channel by a consumer bootstep that starts after Celery's
``Tasks`` step (so again after every reconnection):

* ``can_consume`` is False while the reserved requests fill the pool;
* one claim takes at most the free processes (``can_consume_max_estimate``), where it would take
  every free prefetch slot (``worker_prefetch_multiplier`` x processes);
* a request that ends frees a process: the event loop's tick then asks for a claim turn. An ack
  on receipt (the default) came before the task ended, and found no free process.

The step is added at ``celeryd_init`` (connected by ``import pgbroker``), in a worker whose
broker is pgbroker and whose configuration sets ``worker_disable_prefetch``; Celery's warning is
then dropped by a filter on its logger and an INFO line says the setting is honoured. Celery 5.4
and 5.5 have no such setting (nor the option): ``worker_disable_prefetch = True`` in the app's
configuration is honoured there all the same.

Limits: only in the worker's event loop (prefork, threads and solo pools; not eventlet or gevent,
as in Celery). Tasks held back by a ``rate_limit`` count as reserved, as on Redis.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Any

from celery import bootsteps, signals
from celery.worker import state
from celery.worker.consumer.tasks import Tasks

from ..transport import Transport
from .app import find

__all__ = ["DisablePrefetch", "connect", "on_celeryd_init"]

logger = logging.getLogger(__name__)

#: How Celery's warning that it ignores the setting begins (celery/worker/consumer/tasks.py).
CELERY_WARNING = "worker_disable_prefetch is only supported for Redis brokers"


class _HonouredHere(logging.Filter):
    """Drops Celery's warning that it ignores ``worker_disable_prefetch``: pgbroker does not."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CELERY_WARNING)


class _Gate:
    """The task channel's QoS of one consumer start, held to the pool's free processes."""

    def __init__(self, c: Any, qos: Any, transport: Transport):
        self.c = c
        self.transport = transport
        self.closed = False  # a claim was refused: the next freed process asks for a turn
        self._can_consume = qos.can_consume
        self._estimate = qos.can_consume_max_estimate
        gate = self

        def can_consume(qos: Any) -> bool:
            if gate.free() <= 0:
                gate.closed = True
                return False
            return bool(gate._can_consume())

        def can_consume_max_estimate(qos: Any) -> int:
            slots = gate._estimate()  # None: no prefetch limit
            free = max(gate.free(), 0)
            return free if slots is None else min(slots, free)

        qos.can_consume = MethodType(can_consume, qos)
        qos.can_consume_max_estimate = MethodType(can_consume_max_estimate, qos)

    def limit(self) -> int:
        """The pool's processes, as Celery counts them for Redis."""
        limit: int = (getattr(self.c.controller, "max_concurrency", None)
                      or self.c.pool.num_processes)
        return limit

    def free(self) -> int:
        return self.limit() - len(state.reserved_requests)

    def on_tick(self) -> None:
        """Every turn of the event loop: a process freed since a claim was refused asks for one."""
        if self.closed and self.free() > 0:
            self.closed = False
            self.transport.consumer.request_turn()


class DisablePrefetch(bootsteps.StartStopStep):
    """Consumer bootstep: the gate on the task channel just opened by Celery's ``Tasks``."""

    requires = (Tasks,)

    def __init__(self, c: Any, **kwargs: Any):
        self.gate: _Gate | None = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        transport = c.connection.transport
        if not isinstance(transport, Transport) or c.task_consumer is None:
            return
        self.gate = _Gate(c, c.task_consumer.channel.qos, transport)
        if c.hub is not None:
            c.hub.on_tick.add(self.gate.on_tick)
        logger.info("pgbroker: worker_disable_prefetch: claims only for free pool processes "
                    "(%d)", self.gate.limit())

    def stop(self, c: Any) -> None:
        if self.gate is not None and c.hub is not None:
            c.hub.on_tick.discard(self.gate.on_tick)
        self.gate = None


def on_celeryd_init(sender: Any = None, instance: Any = None, conf: Any = None,
                    **_: Any) -> None:
    """Celery's ``celeryd_init`` (a worker, before its blueprints are built): the step, and the
    filter on Celery's warning, when the setting is on and the broker is pgbroker."""
    app = getattr(instance, "app", None)
    if app is None or not (conf or app.conf).get("worker_disable_prefetch"):
        return
    if find(app) is None:
        return
    app.steps["consumer"].add(DisablePrefetch)
    celery_logger = logging.getLogger(Tasks.__module__)
    if not any(isinstance(f, _HonouredHere) for f in celery_logger.filters):
        celery_logger.addFilter(_HonouredHere())


def connect() -> None:
    """Connect :func:`on_celeryd_init` to Celery's signal (done by ``import pgbroker``)."""
    signals.celeryd_init.connect(on_celeryd_init, weak=False, dispatch_uid="pgbroker.prefetch")
