"""Transactional, idempotent enqueue: jobs written in the caller's own transaction.

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
  :func:`_current_target` where to write.

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
import contextvars
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from kombu.compression import compress
from kombu.serialization import dumps
from kombu.utils.uuid import uuid as task_uuid
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from . import _db
from ._messages import message_to_job
from ._store import NewJob, insert_many_params, queries
from .errors import ConfigurationError, MessageError, SchemaError
from .settings import Settings

__all__ = ["enqueue", "enqueue_many", "transaction"]

logger = logging.getLogger(__name__)

#: The keyword options of :func:`enqueue`, also accepted in :func:`enqueue_many`'s option dicts.
OPTIONS = frozenset({"queue", "idempotency_key", "countdown", "eta", "expires", "priority",
                     "max_attempts", "headers"})

#: A ``db`` argument: SQLAlchemy ``Session``/``Connection`` (psycopg 3 driver) or psycopg 3.
Db = Any

#: Jobs per statement in enqueue_many and in a transaction() block's flush.
BATCH_SIZE = 1000


def enqueue(db: Db, task: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
            *, queue: str | None = None, idempotency_key: str | None = None,
            countdown: float | None = None, eta: datetime | None = None,
            expires: float | datetime | None = None, priority: int | None = None,
            max_attempts: int | None = None, headers: dict[str, Any] | None = None,
            app: Any = None) -> uuid.UUID:
    """Write one Celery task message in ``db``'s current transaction; return the job's id.

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
        app: the Celery app (default: the task's app, else ``celery.current_app``).

    Raises:
        IdempotencyKeyRequired: (a ``ValueError``) the task requires a key and none was given.
        MessageError: (a ``ValueError``) a bad option or message; nothing was written.
        TypeError: ``db`` is not a supported connection, or the arguments do not fit the task.
        ConfigurationError: the app does not use a pgbroker broker.
        SchemaError: the database of ``db`` has no pgbroker schema.
    """
    app = _app(app, task)
    settings = _settings(app)
    job = _build(app, settings, task, args, kwargs, {
        "queue": queue, "idempotency_key": idempotency_key, "countdown": countdown, "eta": eta,
        "expires": expires, "priority": priority, "max_attempts": max_attempts,
        "headers": headers})
    conn = _driver_connection(db)
    q = queries(settings.schema)
    with _translate(settings):
        cur = conn.cursor(row_factory=tuple_row)
        cur.execute(q["job_insert"], {**job.params(), "channel": settings.channel})
        # job_insert returns one row per NOTIFY sent: one when the row was inserted, none for a
        # duplicate (ON CONFLICT DO NOTHING), whose existing job is looked up.
        if cur.rowcount:
            return job.id
        found = [row[0] for row in cur.execute(q["job_enqueued_ids"], _lookup_params([job]))]
    return _resolve([job], found)[job.id]


def enqueue_many(db: Db, jobs: Iterable[Sequence[Any]], *, app: Any = None,
                 batch_size: int = BATCH_SIZE) -> list[uuid.UUID]:
    """Write many task messages in ``db``'s current transaction, one statement per batch.

    Each item is ``(task, args, kwargs, options)`` (trailing parts may be left out); ``options``
    takes :func:`enqueue`'s keywords. Every message is built and validated before anything is
    written, so a bad item raises with nothing written. Returns the job ids in input order (for a
    duplicate idempotency key, the existing job's id). A batch whose jobs carry idempotency keys
    adds a look-up statement, pipelined with the insert: still one round trip.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    settings_of: dict[int, Settings] = {}
    built: list[tuple[Settings, NewJob]] = []
    for index, item in enumerate(jobs):
        task, args, kwargs, options = _unpack(index, item)
        item_app = _app(app, task)
        settings = settings_of.get(id(item_app))
        if settings is None:
            settings = settings_of[id(item_app)] = _settings(item_app)
        built.append((settings, _build(item_app, settings, task, args, kwargs, options)))
    if not built:
        return []
    duplicates = _write(_driver_connection(db), built, batch_size)
    return [duplicates.get(job.id, job.id) for _, job in built]


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
    target = _Target(db)
    token = _target.set(target)
    try:
        with target.hooks():
            try:
                yield
            except Exception:
                target.flush_on_error()
                raise
            except BaseException:
                target.discard()
                raise
            target.flush()
    finally:
        _target.reset(token)


def _current_target() -> _Target | None:
    """Where the transport's ``Channel._put`` must write: the innermost open
    :func:`transaction` of this context, or None (the broker's own connection)."""
    return _target.get()


# -- transaction(): the buffer -------------------------------------------------------------------

class _Target:
    """The jobs published inside one :func:`transaction` block, waiting for its flush."""

    def __init__(self, db: Db):
        self.db = db
        self.raw = not type(db).__module__.startswith("sqlalchemy.")  # no SQLAlchemy events
        self._jobs: list[tuple[Settings, NewJob]] = []
        _driver_connection(db)  # refuse an unsupported db now, not at the first publish

    def add(self, job: NewJob, settings: Settings) -> None:
        """Buffer one message (called by the transport's ``Channel._put``)."""
        if not self._jobs:
            # Join the transaction open now (SQLAlchemy: begin it), so that a rollback before
            # the flush drops these jobs, and a psycopg one opened here lets flush() tell
            # whether the caller ended it inside the block.
            conn = _driver_connection(self.db)
            if (self.raw and not conn.autocommit
                    and conn.info.transaction_status == TransactionStatus.IDLE):
                conn.execute("SELECT 1")
        self._jobs.append((settings, job))

    def flush(self) -> None:
        """Write what is buffered into the caller's current transaction (a statement a batch)."""
        if not self._jobs:
            return
        conn = _driver_connection(self.db)
        if self.raw and not conn.autocommit and (
                conn.info.transaction_status != TransactionStatus.INTRANS):
            count = len(self._jobs)
            self._jobs.clear()
            raise RuntimeError(
                f"pgbroker.transaction: the connection's transaction ended inside the block, so "
                f"the {count} job(s) published in it were not written; commit (or roll back) "
                "after leaving the `with pgbroker.transaction(conn):` block")
        jobs, self._jobs = self._jobs, []
        _write(conn, jobs, BATCH_SIZE)

    def flush_on_error(self) -> None:
        """Leaving by an exception: write into a still healthy transaction, else drop."""
        if not self._jobs:
            return
        try:
            if _driver_connection(self.db).info.transaction_status == TransactionStatus.INERROR:
                self.discard()  # the transaction can only roll back
            else:
                self.flush()
        except Exception as exc:  # noqa: BLE001 - the caller's own exception must propagate
            logger.warning("pgbroker.transaction: %d job(s) not written while leaving the block "
                           "on an exception: %s", len(self._jobs), exc)
            self.discard()

    def discard(self) -> None:
        self._jobs.clear()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """SQLAlchemy events: flush before a commit, drop the buffer at a rollback."""
        if self.raw:
            yield
            return
        from sqlalchemy import event
        from sqlalchemy.orm import Session, scoped_session

        db = self.db() if isinstance(self.db, scoped_session) else self.db
        flush = lambda *_: self.flush()  # noqa: E731
        discard = lambda *_: self.discard()  # noqa: E731
        if isinstance(db, Session):  # session events outlive its connections
            listeners = [(db, "before_commit", flush), (db, "after_rollback", discard)]
        else:
            listeners = [(db, "commit", flush), (db, "rollback", discard)]
        for target, name, fn in listeners:
            event.listen(target, name, fn)
        try:
            yield
        finally:
            for target, name, fn in listeners:
                event.remove(target, name, fn)


_target: contextvars.ContextVar[_Target | None] = contextvars.ContextVar(
    "pgbroker_transaction", default=None)


# -- building messages ---------------------------------------------------------------------------

def _app(app: Any, task: Any) -> Any:
    if app is not None:
        return app
    task_app = getattr(task, "app", None) if not isinstance(task, str) else None
    if task_app is not None:
        return task_app
    from celery import current_app

    return current_app._get_current_object()


def _settings(app: Any) -> Settings:
    """The pgbroker settings of ``app``'s broker (its ``broker_transport_options``)."""
    from kombu.transport import resolve_transport

    from .transport import Transport  # not at import time: transport.py imports this module

    try:
        conn = app.connection_for_write()  # no I/O: kombu only parses the URL
        transport_cls = resolve_transport(conn.transport_cls)
    except Exception as exc:  # noqa: BLE001 - e.g. the client library of another broker
        raise ConfigurationError(f"pgbroker.enqueue cannot tell the broker of Celery app "
                                 f"{app.main!r}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(transport_cls, type) and issubclass(transport_cls, Transport)):
        raise ConfigurationError(
            f"pgbroker.enqueue writes to pgbroker's jobs table, but Celery app {app.main!r} uses "
            f"the {conn.transport_cls!r} broker: set broker_url = 'pgbroker://user@host/db'")
    return Settings.from_options(conn.transport_options)


def _task_of(app: Any, task: Any) -> tuple[str, Any]:
    """(name, task object or None) of a task object or a name."""
    if isinstance(task, str):
        if not task:
            raise MessageError("the task name is empty")
        return task, app._tasks.get(task)  # like send_task: no finalize for a remote name
    name = getattr(task, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"task must be a Celery task or a task name, not {task!r}")
    return name, task


def _build(app: Any, settings: Settings, task: Any, args: Any, kwargs: Any,
           options: dict[str, Any]) -> NewJob:
    """A Celery protocol-2 message for ``task``, as the row the transport would write for it.

    Mirrors ``Task.apply_async`` / ``Celery.send_task``: the task's execution options, the
    router, parent and root ids, ``as_task_v2`` for headers and body, the task's serializer and
    compression. Only ``expires`` is carried by its header alone (no AMQP ``expiration``).
    """
    unknown = set(options) - OPTIONS
    if unknown:
        raise TypeError(f"unknown enqueue option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    name, task_type = _task_of(app, task)
    args = () if args is None else args
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"task args must be a list or tuple, not {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"task kwargs must be a mapping, not {type(kwargs).__name__}")
    _check_options(options)
    check_arguments = getattr(task_type, "__header__", None)
    if check_arguments is not None and getattr(task_type, "typing", False):
        check_arguments(*args, **kwargs)  # TypeError for arguments the task cannot take
    exec_options: dict[str, Any] = {}
    if task_type is not None and hasattr(task_type, "_get_exec_options"):
        exec_options = {k: v for k, v in task_type._get_exec_options().items() if v is not None}
    explicit = {k: options.get(k) for k in ("queue", "priority", "expires")}
    exec_options.update({k: v for k, v in explicit.items() if v is not None})
    route = app.amqp.router.route(exec_options, name, args, kwargs, task_type)
    queue = route.get("queue")
    if queue is None:
        raise MessageError(f"the route of task {name!r} names no queue ({route!r}); "
                           "pgbroker.enqueue writes to a queue, not through an exchange")
    queue_name = queue if isinstance(queue, str) else queue.name
    headers = dict(options.get("headers") or {})
    for key in ("idempotency_key", "max_attempts"):
        value = options.get(key)
        if value is None:
            continue
        if headers.get(key, value) != value:
            raise MessageError(f"{key} is given twice with different values: {value!r} and "
                               f"headers[{key!r}] = {headers[key]!r}")
        headers[key] = value
    root_id = parent_id = None
    parent = app.current_worker_task
    if parent:
        root_id = parent.request.root_id or parent.request.id
        parent_id = parent.request.id
    task_id = task_uuid()
    ignore_result = getattr(task_type, "ignore_result", app.conf.task_ignore_result)
    try:
        message = app.amqp.as_task_v2(
            task_id, name, args, kwargs, countdown=options.get("countdown"),
            eta=options.get("eta"), expires=route.get("expires"), reply_to=app.thread_oid,
            time_limit=route.get("time_limit"), soft_time_limit=route.get("soft_time_limit"),
            root_id=root_id, parent_id=parent_id, ignore_result=ignore_result)
    except ValueError as exc:  # Celery's own check of countdown / expires
        raise MessageError(str(exc)) from exc
    message.headers.update(headers)
    content_type, content_encoding, body = dumps(
        message.body, serializer=route.get("serializer") or app.conf.task_serializer)
    compression = route.get("compression") or app.conf.task_compression
    if compression:
        body, message.headers["compression"] = compress(body, compression)
    properties = {
        **message.properties,
        "delivery_mode": 2,  # persistent: every pgbroker message is a durable row anyway
        "priority": route.get("priority") or 0,
        "body_encoding": None,
        "delivery_info": {"exchange": "", "routing_key": queue_name},
    }
    return _message_to_job(settings, queue_name, {
        "body": body, "content-type": content_type, "content-encoding": content_encoding,
        "headers": message.headers, "properties": properties})


def _check_options(options: dict[str, Any]) -> None:
    """Refuse option values Celery would accept silently or fail on obscurely."""
    priority = options.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)
                                 or not 0 <= priority <= 255):
        raise MessageError(f"priority must be an integer from 0 to 255, not {priority!r}")
    for key in ("eta", "expires"):
        value = options.get(key)
        if key == "expires" and isinstance(value, (int, float)) and not isinstance(value, bool):
            continue
        if value is not None and not isinstance(value, (datetime, str)):
            raise MessageError(f"{key} must be a datetime or an ISO 8601 string"
                               f"{' or seconds' if key == 'expires' else ''}, not {value!r}")
    countdown = options.get("countdown")
    if countdown is not None and (not isinstance(countdown, (int, float))
                                  or isinstance(countdown, bool)):
        raise MessageError(f"countdown must be a number of seconds, not {countdown!r}")
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, Mapping):
        raise MessageError(f"headers must be a mapping, not {type(headers).__name__}")


def _message_to_job(settings: Settings, queue: str, message: dict[str, Any]) -> NewJob:
    """The transport's own message -> row conversion (every publish check lives there)."""
    return message_to_job(settings, queue, message)


def _unpack(index: int, item: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or not 1 <= len(item) <= 4:
        raise TypeError(f"enqueue_many item {index} must be (task, args, kwargs, options) with "
                        f"the trailing parts optional, not {item!r}")
    # the parts left out take their defaults: args (), kwargs None, options None
    task, args, kwargs, options = [*item, *[(), None, None][len(item) - 1:]]
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"enqueue_many item {index}: options must be a dict, not {options!r}")
    return task, args, kwargs, options or {}


# -- writing -------------------------------------------------------------------------------------

def _driver_connection(db: Db) -> psycopg.Connection[Any]:
    """The psycopg connection under ``db``, inside the caller's (SQLAlchemy) transaction."""
    if isinstance(db, psycopg.Connection):
        return db
    if type(db).__module__.startswith("django."):
        from .contrib.django import driver_connection

        return driver_connection(db)
    if type(db).__module__.startswith("sqlalchemy."):
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session, scoped_session

        if isinstance(db, scoped_session):
            db = db()
        if isinstance(db, Session):
            db = db.connection()  # begins the session's transaction if none is open
        if isinstance(db, Connection):
            if not db.in_transaction():
                db.begin()  # what SQLAlchemy's autobegin does: the caller's commit ends it
            driver = db.connection.driver_connection
            if isinstance(driver, psycopg.Connection):
                return driver
            raise TypeError(
                f"pgbroker needs the psycopg 3 driver, but this SQLAlchemy connection uses "
                f"{db.dialect.name}+{db.dialect.driver}: create the engine with a "
                "postgresql+psycopg:// URL")
    raise TypeError("pgbroker needs a SQLAlchemy Session or Connection, a Django connection or "
                    f"a psycopg 3 Connection (synchronous), not {type(db).__module__}.{type(db).__name__}")


def _write(conn: psycopg.Connection[Any], jobs: Sequence[tuple[Settings, NewJob]],
           batch_size: int) -> dict[uuid.UUID, uuid.UUID]:
    """Insert ``jobs`` in batches, one statement per batch and destination schema (normally
    one). Returns {id made for a job that was a duplicate: the existing job's id}."""
    duplicates: dict[uuid.UUID, uuid.UUID] = {}
    for start in range(0, len(jobs), batch_size):
        by_schema: dict[str, tuple[Settings, list[NewJob]]] = {}
        for settings, job in jobs[start:start + batch_size]:
            by_schema.setdefault(settings.schema, (settings, []))[1].append(job)
        for settings, batch in by_schema.values():
            duplicates.update(_insert_many(conn, settings, batch))
    return duplicates


def _insert_many(conn: psycopg.Connection[Any], settings: Settings,
                 jobs: list[NewJob]) -> dict[uuid.UUID, uuid.UUID]:
    """``job_insert_many`` for ``jobs``; keyed jobs are then looked up in the same round trip.

    Returns {id made for a job that was a duplicate: the existing job's id}.
    """
    q = queries(settings.schema)
    keyed = [job for job in jobs if job.idempotency_key is not None]
    with _translate(settings):
        if not keyed:
            conn.cursor(row_factory=tuple_row).execute(
                q["job_insert_many"], insert_many_params(jobs, settings.channel))
            return {}
        # The look-up is what tells an inserted job from a duplicate: pipelined, so the batch
        # still costs one round trip.
        with conn.pipeline():
            conn.cursor(row_factory=tuple_row).execute(
                q["job_insert_many"], insert_many_params(jobs, settings.channel))
            lookup = conn.cursor(row_factory=tuple_row)
            lookup.execute(q["job_enqueued_ids"], _lookup_params(keyed))
        found = [row[0] for row in lookup.fetchall()]
    return {made: job_id for made, job_id in _resolve(keyed, found).items() if made != job_id}


def _resolve(jobs: list[NewJob], found: list[uuid.UUID | None]) -> dict[uuid.UUID, uuid.UUID]:
    """{id made: id of the job it ended up as}, from ``job_enqueued_ids``'s answer.

    None means the duplicate was deleted (pruned, purged) between the insert and the look-up: a
    race of microseconds, reported rather than retried, since the caller's transaction already
    holds the rest of its work.
    """
    resolved: dict[uuid.UUID, uuid.UUID] = {}
    for job, job_id in zip(jobs, found, strict=True):
        if job_id is None:
            raise RuntimeError(f"pgbroker: the job duplicating {job.task!r} (key "
                               f"{job.idempotency_key!r}) was deleted during the insert; "
                               "enqueue it again")
        resolved[job.id] = job_id
    return resolved


def _lookup_params(jobs: Sequence[NewJob]) -> dict[str, list[Any]]:
    return {
        "id": [j.id for j in jobs], "task": [j.task for j in jobs],
        "idempotency_key": [j.idempotency_key for j in jobs], "queue": [j.queue for j in jobs],
        "task_id": [j.task_id for j in jobs], "retries": [j.retries for j in jobs],
    }


@contextlib.contextmanager
def _translate(settings: Settings) -> Iterator[None]:
    """Driver errors as pgbroker's; a missing schema as a SchemaError that says what to do."""
    try:
        with _db.translate_errors("pgbroker enqueue"):
            yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaError(
            f"no pgbroker schema {settings.schema!r} in the database of this connection: it "
            "must be the broker's database (run `pgbroker migrate` there)") from exc
