"""Exactly once for work in the broker's database: a task completes its own delivery in its own
transaction.

Most tasks of a PostgreSQL shop write to the database that holds the queue. Such a task can mark
its delivery done inside the transaction of its own writes::

    @app.task(acks_late=True)
    def confirm(reservation_id):
        with Session(engine) as session, session.begin():
            session.get(Reservation, reservation_id).confirm()
            pgbroker.complete(session)          # commits with the writes above, or not at all

The completion is an UPDATE of the delivery's own row, matched by (job id, attempt), so it and
the task's writes commit together or not at all:

* the worker dies (or the transaction rolls back) before that commit: nothing of it stays, the
  delivery is redelivered as usual, and the task runs again on clean data;
* after the commit: the job is ``completed``; it is never redelivered (the sweeper rescues only
  ``running`` jobs), and the worker's own late ack, or its failure hook if the task raises
  afterwards, changes nothing.

When it does not hold: the same database and that transaction only. An e-mail sent, an HTTP call
made or a file written before the commit happens again when the task runs again; a write on
another connection (or another database) is not in the transaction. And
``task_acks_late`` must be on: acked on receipt, the delivery is already ``completed`` before the
task runs, and :func:`complete` refuses (the task's transaction must then not commit).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from celery import current_task
from psycopg.pq import TransactionStatus

from .._model.message import parse_delivery_tag
from .._pg.catalogue import Queries
from .._produce.connectors import connector_for
from ..errors import DeliveryLost
from .app import settings_of

__all__ = ["complete", "current_delivery"]

_queries: dict[int, Queries] = {}
_lock = threading.Lock()


def current_delivery(task: Any = None) -> tuple[uuid.UUID, int]:
    """(job id, attempt) of the delivery ``task`` (default: Celery's current task) runs for.

    Raises:
        DeliveryLost: no task is running, or its message was not delivered by pgbroker.
    """
    task = task if task is not None else current_task
    request = getattr(task, "request", None) if task is not None else None
    properties = getattr(request, "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    delivery = parse_delivery_tag(tag) if isinstance(tag, str) and "/" in tag else None
    if delivery is None:
        raise DeliveryLost("pgbroker.complete() must be called from a task that a pgbroker "
                           f"worker is running (delivery tag: {tag!r})")
    return delivery[0], delivery[1]


def complete(db: Any, task: Any = None) -> None:
    """Mark the current delivery done inside ``db``'s open transaction.

    Args:
        db: the task's own SQLAlchemy ``Session``/``Connection`` (psycopg 3 driver), Django
            connection or psycopg 3 ``Connection``, on the broker's database, inside the
            transaction that holds the task's writes. Never committed here.
        task: the running task (default: Celery's current task).

    Raises:
        DeliveryLost: this delivery is no longer the task's to complete -- the sweeper gave it
            back (its worker looked lost) and it may run elsewhere, it was acked on receipt
            (``task_acks_late`` off), or it was completed already. Let the exception end the
            transaction: committing would apply the task's writes twice or without a job.
        TypeError: ``db`` is not a supported connection, or it is a psycopg connection in
            autocommit mode outside a transaction block (the completion would commit alone).
    """
    job_id, attempt = current_delivery(task)
    task = task if task is not None else current_task
    conn = connector_for(db).connection()
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise TypeError("pgbroker.complete() needs the task's open transaction, but this psycopg "
                        "connection is in autocommit mode outside `with conn.transaction():` -- "
                        "the completion would commit alone, apart from the task's writes")
    q = _queries_of(task.app)
    if q.one(conn, "job_complete", {"id": job_id, "attempt": attempt})[0]:
        return
    row = q.one(conn, "job_delivery_state", {"id": job_id})
    raise DeliveryLost(_why_not(job_id, attempt, row))


def _why_not(job_id: uuid.UUID, attempt: int, row: Any) -> str:
    if row is None:
        return f"job {job_id} no longer exists"
    state, attempts, completed_attempt = row
    if completed_attempt == attempt:
        return f"delivery {job_id}/{attempt} was completed already"
    if attempts != attempt:
        return (f"delivery {job_id}/{attempt} was taken back (its worker looked lost) and the job "
                f"is now at attempt {attempts} ({state}): do not commit this run's writes")
    if state == "completed":
        return (f"delivery {job_id}/{attempt} was acked on receipt: pgbroker.complete() needs "
                "task_acks_late = True")
    return f"delivery {job_id}/{attempt} is {state}, not running"


def _queries_of(app: Any) -> Queries:
    key = id(app)
    with _lock:
        if key not in _queries:
            _queries[key] = Queries(settings_of(app).schema)  # no I/O: kombu parses the URL
        return _queries[key]
