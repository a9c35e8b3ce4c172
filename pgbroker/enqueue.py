"""Transactional, idempotent enqueue: jobs written in the caller's own transaction.

The public API only; its rooms: :mod:`pgbroker._produce.build` makes the Celery messages,
:mod:`pgbroker._produce.write` writes them (the parameters: :mod:`pgbroker._model.job`),
:mod:`pgbroker._produce.connectors` finds the connection under ``db``,
:mod:`pgbroker._produce.transaction` holds the ``transaction()`` block's buffer,
:mod:`pgbroker._celery.app` tells the app's broker.

Two ways in:

* :func:`enqueue` and :func:`enqueue_many` build real Celery protocol-2 messages (with Celery's
  own ``app.amqp.as_task_v2``, the app's router and kombu's serializers), turn them into rows
  exactly as the transport does, and INSERT them on the caller's connection: a SQLAlchemy
  ``Session`` or ``Connection`` (psycopg 3 driver) or a psycopg 3 ``Connection``. They never
  commit: the job exists exactly when the caller commits, and the wake-up NOTIFY, sent by the
  same statement, is delivered by PostgreSQL only at that commit (never for a rollback).
* ``with transaction(db):`` sends every pgbroker publish made in this thread / context
  (``.delay()``, ``.apply_async()``, ``send_task()``, ``chain``, ``group``) through ``db``
  instead of the broker's own autocommit connection. The transport's ``Channel._put`` asks
  :func:`pgbroker._produce.transaction.current_target` where to write.

Limits, stated honestly:

* ``db`` must be connected to the broker's database. The schema and ``require_idempotency_key``
  come from the app's ``broker_transport_options``; the app must use a ``pgbroker://`` broker.
* A psycopg connection in autocommit mode has no transaction to join: each insert is its own.
* A duplicate (same task and idempotency key) inserts nothing and the existing job's id is
  returned. If that job was written by another transaction still open, the insert waits for it
  to end (a unique index's rule). Under REPEATABLE READ or SERIALIZABLE, a duplicate committed by
  a concurrent transaction after ours began raises a serialization failure (PostgreSQL's rule for
  ON CONFLICT), to be retried like any other.
* :func:`enqueue` writes to the queue the app's router chooses; exchange bindings are not
  consulted (a route naming only an exchange is refused). The queue is not registered in the
  ``queues`` table: its consumers declare it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

from ._celery import eager as _eager
from ._celery.app import settings_of
from ._model.job import NewJob
from ._produce import transaction as _target
from ._produce import write as _write
from ._produce.build import OPTIONS, Planned, Templates, app_of, build, unpack
from ._produce.connectors import connector_for
from ._produce.write import BATCH_SIZE
from .settings import Settings

__all__ = ["enqueue", "enqueue_many", "transaction", "OPTIONS", "BATCH_SIZE"]

#: A ``db`` argument: SQLAlchemy ``Session``/``Connection`` (psycopg 3 driver), a Django
#: connection or psycopg 3 ``Connection``: see :mod:`pgbroker._produce.connectors`.
Db = Any


def enqueue(db: Db, task: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
            *, queue: str | None = None, idempotency_key: str | None = None,
            countdown: float | None = None, eta: datetime | None = None,
            expires: float | datetime | None = None, priority: int | None = None,
            max_attempts: int | None = None, headers: dict[str, Any] | None = None,
            dedupe_key: str | None = None, dedupe_active: bool | None = None,
            concurrency_key: str | None = None, concurrency_limit: int | None = None,
            app: Any = None) -> uuid.UUID:
    """Write one Celery task message in ``db``'s current transaction; return the job's id.

    Under ``task_always_eager`` a task the app knows runs now instead, as ``.delay()`` runs it,
    and its task id is returned (:mod:`pgbroker._celery.eager`).

    Args:
        db: a SQLAlchemy ``Session`` or ``Connection`` (``postgresql+psycopg://``) or a psycopg 3
            ``Connection``, connected to the broker's database. Never committed here.
        task: a Celery task object or a task name.
        args, kwargs: the task's arguments (serialized with the task's or app's serializer).
        queue: overrides the queue the app's router chooses.
        idempotency_key: at most one job per (task, key): a duplicate inserts nothing, raises
            nothing, and the existing job's id is returned.
        countdown, eta, expires, priority: as in ``apply_async``.
        max_attempts: deliveries before the job goes ``dead`` (default: the transport option).
        headers: extra message headers, as ``apply_async(headers=...)``.
        dedupe_key: at most one copy of (task, key) queued (not started yet): a duplicate
            inserts nothing, raises nothing, and the queued copy's id is returned. With
            ``dedupe_active=True`` also none while a copy runs (README: "Dedupe while queued").
        concurrency_key, concurrency_limit: copies with the key run ``concurrency_limit``
            (default 1) at a time across all workers; they wait in the queue meanwhile.
        app: the Celery app (default: the task's app, else ``celery.current_app``).

    Raises:
        IdempotencyKeyRequired: (a ``ValueError``) the task requires a key and none was given.
        MessageError: (a ``ValueError``) a bad option or message; nothing was written.
        TypeError: ``db`` is not a supported connection, or the arguments do not fit the task.
        ConfigurationError: the app does not use a pgbroker broker.
        SchemaError: the database of ``db`` has no pgbroker schema.
    """
    options = {
        "queue": queue, "idempotency_key": idempotency_key, "countdown": countdown, "eta": eta,
        "expires": expires, "priority": priority, "max_attempts": max_attempts,
        "headers": headers, "dedupe_key": dedupe_key, "dedupe_active": dedupe_active,
        "concurrency_key": concurrency_key, "concurrency_limit": concurrency_limit}
    eager = _eager.eager_task(app, task)
    # task_always_eager: run it now, as .delay() does (pgbroker._celery.eager)
    if eager is not None:
        _eager.checked(app, task, lambda: job_for(app, task, args, kwargs, options))
        return _eager.run(eager, args, kwargs, headers)
    settings, job = job_for(app, task, args, kwargs, options)
    return _write.insert(connector_for(db).connection(), settings, job)


def enqueue_many(db: Db, jobs: Iterable[Sequence[Any]], *, app: Any = None,
                 batch_size: int = BATCH_SIZE) -> list[uuid.UUID]:
    """Write many task messages in ``db``'s current transaction, one statement per batch.

    Each item is ``(task, args, kwargs, options)`` (trailing parts may be left out); ``options``
    takes :func:`enqueue`'s keywords. Every message is built and validated before anything is
    written, so a bad item raises with nothing written. Returns the job ids in input order (for a
    duplicate idempotency key, the existing job's id). A batch whose jobs carry idempotency keys
    adds a look-up statement, pipelined with the insert: still one round trip. Inside a
    transaction the batches are pipelined too: the database inserts one while the next is sent.

    The messages are those :func:`enqueue` writes, but for the ids made for each; most of a
    batch's are made from the first of their kind (see :class:`pgbroker._produce.build.Templates`),
    which is much faster.
    """
    # task_always_eager: those run now, after the others are written (pgbroker._celery.eager)
    count, eager, jobs = _eager.prepare(jobs, app, lambda items: jobs_for(items, app, batch_size))
    built, json_of = jobs_for(jobs, app, batch_size)
    written = _write.write(connector_for(db).connection(), built, batch_size, json_of) if built \
        else []
    return _eager.run_many(count, eager, written) if eager else written


@contextlib.contextmanager
def transaction(db: Db) -> Iterator[None]:
    """Send the pgbroker publishes made inside the block through ``db``'s transaction.

    ``.delay()``, ``.apply_async()``, ``send_task()``, ``chain`` and ``group`` called in this
    thread (or asyncio context) inside the block are validated at once (a missing required
    idempotency key raises there), buffered, and written in one statement (so a ``group`` of N is
    one round trip) at the first of:

    * a commit inside the block, with SQLAlchemy (``before_commit`` / ``commit`` events);
    * leaving the block, normally or by an exception, unless the transaction has already failed.
      Whether the jobs then exist is decided by the caller's commit or rollback.

    A SQLAlchemy rollback inside the block drops what was buffered. A raw psycopg connection has
    no commit hook: commit after leaving the block. Committing or rolling it back inside the block
    makes leaving it raise ``RuntimeError`` (the jobs would otherwise land in a transaction
    nobody commits). Limits: a rolled back SAVEPOINT does not drop buffered jobs; the ids returned
    by ``apply_async`` for an idempotent duplicate are the new (unused) task ids.
    """
    with _target.joined(db):
        yield


# -- what the synchronous and the asyncio forms (pgbroker.aio) share: no I/O -------------------

def job_for(app: Any, task: Any, args: Any, kwargs: Any,
            options: dict[str, Any]) -> tuple[Settings, NewJob]:
    """The settings of the broker and the job :func:`enqueue` writes for these arguments and
    :data:`OPTIONS` (checked: the errors :func:`enqueue` documents)."""
    app = app_of(app, task)
    settings = settings_of(app)
    return settings, build(app, settings, task, args, kwargs, options)


def jobs_for(jobs: Iterable[Sequence[Any]], app: Any, batch_size: Any,
             ) -> tuple[list[tuple[Settings, NewJob | Planned]], dict[uuid.UUID, Any]]:
    """What :func:`enqueue_many` writes for ``jobs``: each message built or planned, with its
    settings, and the jsonb values already made (by job id); every item checked."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    settings_of_app: dict[int, Settings] = {}
    built: list[tuple[Settings, NewJob | Planned]] = []
    templates = Templates()
    for index, item in enumerate(jobs):
        task, args, kwargs, options = unpack(index, item)
        item_app = app_of(app, task)
        settings = settings_of_app.get(id(item_app))
        if settings is None:
            settings = settings_of_app[id(item_app)] = settings_of(item_app)
        built.append((settings, templates.build(item_app, settings, task, args, kwargs, options)))
    return built, templates.json_of
