"""Record a task's failure in its job row, from the worker process that ran it.

Celery acks a task that raised (``task_acks_on_failure_or_timeout``, on by default): to the broker
that ack looks like a success. Connected to ``task_failure`` when pgbroker is imported, this hook
writes the error and traceback into the delivery's row first (matched by job id *and* attempt),
and the ack of a failed attempt then ends the job ``dead``: a final failure is a dead letter that
an operator sees and can retry, not a silent ``completed``.

The hook must not fail, or the ack completes the failed job: any text is stored (escaped where
PostgreSQL text cannot hold it: ``pgbroker._text``), and a lost connection is retried on a new
one for up to :data:`RECORD_FOR` seconds, before the pool process hands the task's result back
(so before Celery acks it).

Limits: a pool process killed outside the task (SIGKILL) runs no hook; Celery then rejects the
message (``task_reject_on_worker_lost``) or acks it as a ``WorkerLostError`` failure, which Celery
reports to the main process's hook. A pool process that cannot reach the database for
:data:`RECORD_FOR` seconds while the main process can (its ack gets through) leaves the job
``completed``; it logs the failure at ERROR.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import signals

from ._broker import find
from ._messages import parse_delivery_tag
from ._store import Store
from .errors import DatabaseUnavailable

logger = logging.getLogger(__name__)

#: Seconds a task's failure is retried on a new connection when the database cannot be reached.
RECORD_FOR = 30.0

_stores: dict[tuple[int, int], Store | None] = {}
_lock = threading.Lock()


def _store_for(app: Any) -> Store | None:
    """This process's store for ``app``'s broker (None when the broker is not pgbroker)."""
    key = (os.getpid(), id(app))
    with _lock:
        if key not in _stores:
            broker = find(app)  # no I/O: just the options
            _stores[key] = None if broker is None else Store(
                broker.conninfo, dataclasses.replace(broker.settings, auto_migrate=False),
                application_name="pgbroker failure hook")
        return _stores[key]


def on_task_failure(sender: Any = None, exception: BaseException | None = None,
                    einfo: Any = None, **_: Any) -> None:

    delivery = _delivery_of(getattr(sender, "request", None))
    if delivery is None:
        return  # not delivered by pgbroker
    try:
        job_id, attempt = delivery
        store = _store_for(sender.app)
        if store is None:
            return
        error = _describe(exception)[:10000] if exception is not None else "task failed"
        # a pool process lost (SIGKILL, out of memory) without task_reject_on_worker_lost: Celery
        # fails the task in the main process; it counts towards pausing the task name
        _record(store, job_id, attempt, error, _describe(einfo, name=False) if einfo else None,
                lost=isinstance(exception, WorkerLostError))
    except Exception as exc:  # noqa: BLE001 - never turn a task failure into a worker crash
        logger.error("pgbroker: could not record the failure of job %s (%s): %s; its ack "
                     "may complete it", delivery[0], _describe(exception), exc)


def _delivery_of(request: Any) -> tuple[uuid.UUID, int] | None:
    """(job id, attempt) of a task's request, from the delivery tag pgbroker made
    ("<job id>/<attempt>"): Celery gives the task the message's properties (the headers stay as
    the producer sent them). None for a message pgbroker did not deliver."""
    properties = getattr(request, "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    if not isinstance(tag, str) or "/" not in tag:
        return None
    try:
        delivery = parse_delivery_tag(tag)
    except ValueError:
        return None
    return None if delivery is None else delivery[:2]


def record_unstored_result(app: Any, request: Any, reason: str) -> None:
    """The task of ``request`` succeeded but its result could not be stored (the result
    backend gave up: pgbroker.backend): record ``reason`` in its job row before the ack, which
    then ends the job ``dead`` with it -- never ``completed`` without its result. Retried as a
    failure is; never raises (it logs at ERROR what it could not record)."""
    delivery = _delivery_of(request)
    store = _store_for(app) if delivery is not None else None
    if delivery is None or store is None:
        return  # not delivered by pgbroker: nothing to record here
    try:
        _record(store, *delivery, reason, None)
    except Exception as exc:  # noqa: BLE001 - the caller raises the reason to Celery anyway
        logger.error("pgbroker: could not record that job %s succeeded without a stored "
                     "result (%s): %s; its ack may complete it", delivery[0], reason, exc)


def _describe(value: Any, name: bool = True) -> str:
    """``"<type>: <text>"`` of an exception (its text alone with ``name=False``), even when
    its ``__str__`` raises."""
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - a hostile or broken __str__
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001
            text = "(its text cannot be shown)"
    return f"{type(value).__name__}: {text}" if name else text


def _record(store: Store, job_id: uuid.UUID, attempt: int, error: str,
            traceback: str | None, lost: bool = False) -> None:
    """``store.fail``, retried on a new connection for up to RECORD_FOR seconds when the
    database cannot be reached; a row that refuses the text (a trigger, say) gets the error's
    first line alone."""
    deadline = time.monotonic() + RECORD_FOR
    delay = 0.1
    while True:
        try:
            store.fail(job_id, attempt, error, traceback, lost)
            return
        except DatabaseUnavailable:
            store.close()
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        except Exception as exc:  # noqa: BLE001 - not the connection: try the bare minimum
            logger.warning("pgbroker: recording the failure of job %s failed (%s); recording "
                           "its first line alone", job_id, exc)
            store.fail(job_id, attempt, error.splitlines()[0][:1000] if error else "task failed",
                       None)
            return


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
