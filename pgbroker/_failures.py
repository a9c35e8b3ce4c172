"""Record a task's failure in its job row, from the worker process that ran it.

Celery acks a task that raised (``task_acks_on_failure_or_timeout``, on by default): to the broker
that ack looks like a success. Connected to ``task_failure`` when pgbroker is imported, this hook
writes the error and traceback into the delivery's row first (matched by job id *and* attempt),
and the ack of a failed attempt then ends the job ``dead``: a final failure is a dead letter that
an operator sees and can retry, not a silent ``completed``.

Limit: a pool process killed outside the task (SIGKILL) runs no hook; Celery then rejects the
message (``task_reject_on_worker_lost``) or acks it as a ``WorkerLostError`` failure.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from celery import signals

from ._messages import parse_delivery_tag
from ._store import Store

logger = logging.getLogger(__name__)

_stores: dict[tuple[int, int], Store | None] = {}
_lock = threading.Lock()


def _store_for(app: Any) -> Store | None:
    """This process's store for ``app``'s broker (None when the broker is not pgbroker)."""
    from .transport import Transport

    key = (os.getpid(), id(app))
    with _lock:
        if key not in _stores:
            transport = app.connection_for_write().transport  # no I/O: just the options
            _stores[key] = None if not isinstance(transport, Transport) else Store(
                transport.conninfo, dataclasses.replace(transport.settings, auto_migrate=False),
                application_name="pgbroker failure hook")
        return _stores[key]


def on_task_failure(sender: Any = None, exception: BaseException | None = None,
                    einfo: Any = None, **_: Any) -> None:

    # Celery gives the task the message's properties, with the delivery tag pgbroker made
    # ("<job id>/<attempt>"): the headers stay as the producer sent them.
    properties = getattr(getattr(sender, "request", None), "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    if not isinstance(tag, str) or "/" not in tag:
        return  # not delivered by pgbroker
    try:
        delivery = parse_delivery_tag(tag)
        if delivery is None:
            return
        job_id, attempt, _ = delivery
        store = _store_for(sender.app)
        if store is None:
            return
        error = f"{type(exception).__name__}: {exception}" if exception else "task failed"
        store.fail(job_id, attempt, error[:10000], str(einfo) if einfo else None)
    except Exception as exc:  # noqa: BLE001 - never turn a task failure into a worker crash
        logger.warning("pgbroker: could not record the failure of delivery %s: %s", tag, exc)


def on_task_unknown(sender: Any = None, name: str | None = None, message: Any = None,
                    **_: Any) -> None:
    """Celery rejects a message for a task no worker knows ('rejected by the consumer'): name
    the task in its dead row, so the operator sees why."""
    tag = getattr(message, "delivery_tag", None)
    delivery = parse_delivery_tag(tag) if isinstance(tag, str) and "/" in tag else None
    if delivery is None:
        return
    try:
        store = _store_for(sender.app)
        if store is not None:
            store.fail(delivery[0], delivery[1],
                       f"unregistered task {name!r}: no worker consuming this queue knows it",
                       None)
    except Exception as exc:  # noqa: BLE001 - the rejection itself already happened
        logger.warning("pgbroker: could not record the unknown task %r: %s", name, exc)


def connect() -> None:
    signals.task_failure.connect(on_task_failure, weak=False, dispatch_uid="pgbroker.failures")
    signals.task_unknown.connect(on_task_unknown, weak=False, dispatch_uid="pgbroker.unknown")
