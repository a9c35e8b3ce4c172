"""Record a task's failure in its job row, from the worker process that ran it.

Celery acks a task that raised (``task_acks_on_failure_or_timeout``, on by default): to the broker
that ack looks like a success. Connected to ``task_failure`` when pgbroker is imported, this hook
writes the error and traceback into the delivery's row first (matched by job id *and* attempt),
and the ack of a failed attempt then ends the job ``dead``: a final failure is a dead letter that
an operator sees and can retry, not a silent ``completed``.

The hook must not fail, or the ack completes the failed job: any text is stored (escaped where
PostgreSQL text cannot hold it: ``pgbroker._model.text``), and a lost connection is retried on a new
one for up to ``RECORD_FOR`` seconds (:mod:`pgbroker._celery.hook_store`), before the pool process
hands the task's result back (so before Celery acks it).

A pool process that died under its job (SIGKILL, out of memory, ``os._exit``) runs no hook;
Celery's main process learns it as ``WorkerLostError`` in the task's request (``on_failure``),
then requeues the message (``task_reject_on_worker_lost``) or fails it (this module's hook
records the error). :func:`on_worker_setup` gives each task's request class an ``on_failure``
that first counts that loss against the task (``Store.record_losses``: the evidence a poison
task leaves, 0019_loss_evidence.sql) -- only there: a requeue alone cannot tell it from a task
that raised ``Reject(requeue=True)``. A task whose ``Request`` is set after the worker started
is not counted.

Limits: a pool process that cannot reach the database for :data:`RECORD_FOR` seconds while the
main process can (its ack gets through) leaves the job ``completed``; it logs the failure at
ERROR.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import psycopg
from billiard.exceptions import WorkerLostError
from celery import signals
from kombu.utils.imports import symbol_by_name

from .._model.message import parse_delivery_tag
from .._pg.store import Store
from ..errors import DatabaseUnavailable
from .app import find
from .hook_store import retrying, store_for

logger = logging.getLogger(__name__)


def _store_for(app: Any) -> Store | None:
    """This process's store for ``app``'s broker (None when the broker is not pgbroker)."""
    return store_for(app, "pgbroker failure hook")


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
        # (a pool process lost without task_reject_on_worker_lost: Celery fails the task in the
        # main process, after its request counted the loss: _LossCounting)
        _record(store, job_id, attempt, error, _describe(einfo, name=False) if einfo else None)
    except Exception as exc:  # noqa: BLE001 - never turn a task failure into a worker crash
        logger.error("pgbroker: could not record the failure of job %s (%s): %s; its ack "
                     "may complete it", delivery[0], _describe(exception), exc)


def _delivery_of(request: Any) -> tuple[uuid.UUID, int] | None:
    """(job id, attempt) of a task's request: Celery gives the task the message's properties,
    with the delivery tag pgbroker made (the headers stay as the producer sent them)."""
    properties = getattr(request, "properties", None)
    return _delivery(properties.get("delivery_tag") if isinstance(properties, dict) else None)


def _delivery(tag: Any) -> tuple[uuid.UUID, int] | None:
    """(job id, attempt) of a delivery tag pgbroker made ("<job id>/<attempt>"); None for a
    message pgbroker did not deliver."""
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
            traceback: str | None) -> None:
    """``store.fail``, retried on a new connection for up to RECORD_FOR seconds when the
    database cannot be reached; a row that refuses the text (a trigger, say) gets the error's
    first line alone."""
    try:
        retrying(store, lambda: store.fail(job_id, attempt, error, traceback))
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


class _LossCounting:
    """Mixed into a task's request class in the worker's main process (:func:`on_worker_setup`):
    a pool process that died under the job counts against its task before Celery requeues or
    fails it."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # (an ExceptionWithTraceback)
        # the process is gone: WorkerLostError, or its exit reported before it ended (billiard
        # 4.3) -- unless the worker itself cancelled or revoked the request (Celery's own test)
        if isinstance(exc, WorkerLostError) or (
                isinstance(exc, (SystemExit, KeyboardInterrupt))
                and not getattr(self, "_already_cancelled", False)
                and not getattr(self, "_already_revoked", False)):
            _count_pool_loss(self)
        failed = super().on_failure  # type: ignore[misc]  # (Celery's Request, mixed with)
        return failed(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _count_pool_loss(request: Any) -> None:
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    delivery = _delivery(tag)
    try:
        store = _store_for(request.task.app) if delivery is not None else None
        if store is not None and delivery is not None:
            store.record_losses([delivery])  # (never raises; retried, pgbroker._pg.retry)
    except Exception as exc:  # noqa: BLE001 - never stop Celery's own handling
        logger.warning("pgbroker: could not count the lost pool process of %s: %s", tag, exc)


_counting: dict[type, type] = {}


def on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Celery's ``celeryd_after_setup`` (the worker's main process, before its consumer builds
    the tasks' request classes): each task's ``Request`` gets :class:`_LossCounting` mixed in,
    when the broker is pgbroker."""
    app = getattr(instance, "app", None)
    if app is None or find(app) is None:
        return
    for task in app.tasks.values():
        base = symbol_by_name(task.Request)
        if issubclass(base, _LossCounting):
            continue
        if base not in _counting:
            _counting[base] = type(base.__name__, (_LossCounting, base), {
                "__module__": base.__module__,
                "__doc__": f"{base.__doc__ or ''} (pgbroker counts a lost pool process)"})
        task.Request = _counting[base]


def connect() -> None:
    signals.task_failure.connect(on_task_failure, weak=False, dispatch_uid="pgbroker.failures")
    signals.task_unknown.connect(on_task_unknown, weak=False, dispatch_uid="pgbroker.unknown")
    signals.celeryd_after_setup.connect(on_worker_setup, weak=False,
                                        dispatch_uid="pgbroker.losses")
