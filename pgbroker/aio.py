"""Transactional, idempotent enqueue for asyncio applications (FastAPI, Starlette, aiohttp, ...).

The asyncio forms of :mod:`pgbroker.enqueue`, with the same guarantees::

    job_id = await pgbroker.aenqueue(db, send_confirmation, (order.id,), idempotency_key=...)
    ids = await pgbroker.aenqueue_many(db, [(send_reminder, (user_id,)) for user_id in users])
    async with pgbroker.atransaction(db):
        send_confirmation.delay(order.id)      # written in db's transaction, not the broker's

``db`` is a SQLAlchemy ``AsyncSession``, ``async_scoped_session`` or ``AsyncConnection`` (engine
``create_async_engine("postgresql+psycopg://...")``; SQLAlchemy's asyncio extension needs
``greenlet``: pgbroker's ``asyncio`` extra) or a psycopg 3 ``AsyncConnection``, connected to
the broker's database. The messages are those the synchronous forms write (the same code builds
and checks them); only the statements are awaited, on the caller's connection, in its
transaction: the job exists exactly when the caller commits, the wake-up NOTIFY is delivered at
that commit, a duplicate idempotency key returns the existing job's id (waiting, without
blocking the event loop, for a transaction that holds the same key to end), and bad input raises
before anything is written.

Limits, stated honestly:

* Building the messages is CPU work done on the event loop (tens of microseconds a message;
  :func:`aenqueue_many` of 10,000 jobs holds the loop for some tens of milliseconds between its
  statements).
* ``.delay()`` is a synchronous Celery call even inside :func:`atransaction`. Its message is
  buffered, not written, there; but Celery's producer may still open the broker's own
  (synchronous) connection and declare the queue at a first publish. :func:`aenqueue` never
  touches the broker's connection.
* A synchronous ``with pgbroker.transaction(conn):`` inside an ``atransaction`` block takes the
  publishes made inside it to ``conn`` (the innermost block wins, as blocks nest); the
  synchronous ``pgbroker.enqueue`` and ``transaction`` refuse an asyncio connection, and these
  refuse a synchronous one, each with a TypeError that names the other form.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from ._celery import eager as _eager
from ._produce import transaction as _target
from ._produce import write as _write
from ._produce.connectors import aconnector_for
from .enqueue import BATCH_SIZE, job_for, jobs_for

__all__ = ["aenqueue", "aenqueue_many", "atransaction"]


async def aenqueue(db: Any, task: Any, args: Sequence[Any] = (),
                   kwargs: dict[str, Any] | None = None, *, app: Any = None,
                   **options: Any) -> uuid.UUID:
    """Write one Celery task message in ``db``'s current transaction; return the job's id.

    :func:`pgbroker.enqueue` for an asyncio ``db`` (see the module): the same arguments and
    keywords (``queue``, ``idempotency_key``, ``countdown``, ``eta``, ``expires``,
    ``priority``, ``max_attempts``, ``headers``; an unknown one is a TypeError), the same
    message, the same errors. Never commits.
    """
    eager = _eager.eager_task(app, task)
    # task_always_eager: run it now, as .delay() does (pgbroker._celery.eager)
    if eager is not None:
        _eager.checked(app, task, lambda: job_for(app, task, args, kwargs, options))
        return _eager.run(eager, args, kwargs, options.get("headers"))
    settings, job = job_for(app, task, args, kwargs, options)
    return await _write.ainsert(await aconnector_for(db).connection(), settings, job)


async def aenqueue_many(db: Any, jobs: Iterable[Sequence[Any]], *, app: Any = None,
                        batch_size: int = BATCH_SIZE) -> list[uuid.UUID]:
    """Write many task messages in ``db``'s current transaction, one statement per batch.

    :func:`pgbroker.enqueue_many` for an asyncio ``db``: items ``(task, args, kwargs,
    options)``, all checked before anything is written; the ids in input order (a duplicate's:
    the existing job's); inside a transaction the batches are pipelined.
    """
    # task_always_eager: those run now, after the others are written (pgbroker._celery.eager)
    count, eager, jobs = _eager.prepare(jobs, app, lambda items: jobs_for(items, app, batch_size))
    built, json_of = jobs_for(jobs, app, batch_size)
    written = await _write.awrite(await aconnector_for(db).connection(), built, batch_size,
                                  json_of) if built else []
    return _eager.run_many(count, eager, written) if eager else written


@contextlib.asynccontextmanager
async def atransaction(db: Any) -> AsyncIterator[None]:
    """Send the pgbroker publishes made inside the block through ``db``'s transaction.

    :func:`pgbroker.transaction` for an asyncio ``db``: ``.delay()``, ``.apply_async()``,
    ``send_task()``, ``chain`` and ``group`` called in this asyncio task inside the block (and in
    the tasks it starts, which inherit its context) are checked at once, buffered, and written in
    one statement at the first of: a commit inside the block (SQLAlchemy's events; awaited in
    SQLAlchemy's greenlet), or leaving the block -- normally, or by an exception unless the
    transaction has already failed. A SQLAlchemy rollback inside the block drops the buffer.

    Entering the block joins the caller's transaction (for a psycopg ``AsyncConnection`` with no
    transaction open, that begins one, as its first statement would), so that leaving it can
    tell whether the caller committed inside the block: psycopg has no commit hook, so that
    raises ``RuntimeError`` rather than losing the jobs. Other asyncio tasks, and the code after
    the block, publish through the broker's own connection as before.
    """
    async with _target.ajoined(db):
        yield
