"""Record a task's failure in its job row, from the worker process that ran it.

Celery acks a task that raised (``task_acks_on_failure_or_timeout``, on by default): to the broker
that ack looks like a success. Connected to ``task_failure`` when pgbroker is imported, this hook
writes the error and traceback into the delivery's row first (matched by job id *and* attempt),
and the ack of a failed attempt then ends the job ``dead``: a final failure is a dead letter that
an operator sees and can retry, not a silent ``completed``.

The hook must not fail, or the ack completes the failed job: any text is stored (escaped where
PostgreSQL text cannot hold it: ``pgbroker._text``), and a lost connection is retried on a new
one for up to ``RECORD_FOR`` seconds (:mod:`pgbroker._hookstore`), before the pool process hands
the task's result back (so before Celery acks it).

Limits: a pool process killed outside the task (SIGKILL) runs no hook; Celery then rejects the
message (``task_reject_on_worker_lost``) or acks it as a ``WorkerLostError`` failure, which Celery
reports to the main process's hook. A pool process that cannot reach the database for
``RECORD_FOR`` seconds while the main process can (its ack gets through) leaves the job
``completed``; it logs the failure at ERROR.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import psycopg
from billiard.exceptions import WorkerLostError
from celery import signals

from ._hookstore import retrying, store_for
from ._messages import parse_delivery_tag
from ._store import Store
from .errors import DatabaseUnavailable

logger = logging.getLogger(__name__)


def _store_for(app: Any) -> Store | None:
    """This process's store for ``app``'s broker (None when the broker is not pgbroker)."""
    return store_for(app, "pgbroker failure hook")


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
        error = _describe(exception)[:10000] if exception is not None else "task failed"
        # a pool process lost (SIGKILL, out of memory) without task_reject_on_worker_lost: Celery
        # fails the task in the main process; it counts towards pausing the task name
        _record(store, job_id, attempt, error, _describe(einfo, name=False) if einfo else None,
                lost=isinstance(exception, WorkerLostError))
    except Exception as exc:  # noqa: BLE001 - never turn a task failure into a worker crash
        logger.error("pgbroker: could not record the failure of delivery %s (%s): %s; its ack "
                     "may complete it", tag, _describe(exception), exc)


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
    try:
        retrying(store, lambda: store.fail(job_id, attempt, error, traceback, lost))
    except (DatabaseUnavailable, psycopg.OperationalError):
        raise  # (retried for RECORD_FOR seconds already)
    except Exception as exc:  # noqa: BLE001 - not the connection: try the bare minimum
        logger.warning("pgbroker: recording the failure of job %s failed (%s); recording "
                       "its first line alone", job_id, exc)
        store.fail(job_id, attempt, error.splitlines()[0][:1000] if error else "task failed",
                   None)


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
