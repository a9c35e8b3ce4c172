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
import json
import logging
import os
import struct
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from json.encoder import encode_basestring_ascii as _json_string  # json.dumps of a str
from typing import Any

import psycopg
import uuid6
from celery.utils.saferepr import saferepr
from kombu.compression import compress
from kombu.serialization import dumps
from kombu.utils.uuid import uuid as task_uuid
from psycopg.adapt import Dumper
from psycopg.client_cursor import ClientCursorMixin
from psycopg.pq import Format, TransactionStatus
from psycopg.rows import tuple_row

from . import _db
from ._messages import MAX_ID_BYTES, message_to_job
from ._sql import queries
from ._store import NewJob, insert_many_params, log_duplicates, lookup_params, message_digest
from ._text import ESCAPED, storable
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
        # duplicate (ON CONFLICT DO NOTHING), whose existing job is looked up (and counted).
        if cur.rowcount:
            return job.id
        found = cur.execute(q["job_enqueued_ids"], lookup_params([job])).fetchall()
    log_duplicates([job], found)
    return _resolve([job], found)[job.id]


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
    batch's are made from the first of their kind (see ``_Templates``), which is much faster.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    settings_of: dict[int, Settings] = {}
    built: list[tuple[Settings, NewJob | _Planned]] = []
    templates = _Templates()
    for index, item in enumerate(jobs):
        task, args, kwargs, options = _unpack(index, item)
        item_app = _app(app, task)
        settings = settings_of.get(id(item_app))
        if settings is None:
            settings = settings_of[id(item_app)] = _settings(item_app)
        built.append((settings, templates.build(item_app, settings, task, args, kwargs, options)))
    if not built:
        return []
    return _write(_driver_connection(db), built, batch_size, templates.json_of)


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

    def add_dead(self, job: NewJob, settings: Settings, error: str) -> None:
        """Write a dead letter (an unroutable message: ``job_insert_dead``) into the caller's
        transaction now."""
        conn = _driver_connection(self.db)
        with _translate(settings):
            conn.execute(queries(settings.schema)["job_insert_dead"],
                         {**job.params(), "error": error})

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
           options: dict[str, Any], recipe: dict[str, Any] | None = None) -> NewJob:
    """A Celery protocol-2 message for ``task``, as the row the transport would write for it.

    Mirrors ``Task.apply_async`` / ``Celery.send_task``: the task's execution options, the
    router, parent and root ids, ``as_task_v2`` for headers and body, the task's serializer and
    compression. Only ``expires`` is carried by its header alone (no AMQP ``expiration``).

    ``recipe``, if given, receives what :class:`_Template` needs to make more messages like this
    one: the serializer, the compression, the body's embed part, the argument check.
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
    serializer = route.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, body = dumps(message.body, serializer=serializer)
    compression = route.get("compression") or app.conf.task_compression
    if compression:
        body, message.headers["compression"] = compress(body, compression)
    if recipe is not None:
        recipe.update(serializer=serializer, compression=compression, embed=message.body[2],
                      check_arguments=check_arguments
                      if check_arguments is not None and getattr(task_type, "typing", False)
                      else None)
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


# -- enqueue_many: a batch's messages made from one real message per kind of job ----------------
#
# _build costs tens of microseconds a message, most of it spent on what is the same for every
# job of a task: the router, the app's configuration, the task's execution options. For a batch,
# the first job of each kind (same app, task, queue, priority, max_attempts, with or without an
# idempotency key) is made by _build, and becomes the template of the others: only what
# ``as_task_v2`` makes per job (task id, root id, argsrepr, kwargsrepr, the body) and the key are
# made again, exactly as _build makes them. Whatever could make two jobs of a kind differ in more
# than that (a time, custom headers, a router that reads the arguments, another as_task_v2)
# sends the job to _build.

#: Options a job may carry and still be made from its kind's template: part of the kind
#: (queue, priority, max_attempts), or one header value (idempotency_key).
_TEMPLATE_OPTIONS = frozenset({"queue", "priority", "max_attempts", "idempotency_key"})

#: Deepest nesting _plain_repr renders when ``task_repr_maxlevels`` sets no limit.
_PLAIN_REPR_LEVELS = 8

#: A message planned by _Template.plan: (template, body, content type, content encoding,
#: argsrepr, kwargsrepr, idempotency key).
_Planned = tuple


class _Templates:
    """The templates of one :func:`enqueue_many` call, by kind of job."""

    def __init__(self) -> None:
        self._of: dict[tuple[Any, ...], _Template | None] = {}
        self._keep: list[Any] = []  # apps and tasks keyed by id(): alive as long as their key
        #: {job id: its headers and properties as jsonb binary values} for the jobs made from a
        #: template (_insert_many sends them as they are, rather than json.dumps-ing each dict)
        self.json_of: dict[uuid.UUID, tuple[bytes, bytes]] = {}

    def build(self, app: Any, settings: Settings, task: Any, args: Any, kwargs: Any,
              options: dict[str, Any]) -> NewJob | _Planned:
        """What ``_build(app, settings, task, args, kwargs, options)`` returns, or the same
        message planned: checked, its body and reprs made, to be finished by
        :meth:`_Template.finish` (which cannot fail) when its batch is written."""
        kind = _kind(app, task, options)
        if kind is None:
            return _build(app, settings, task, args, kwargs, options)
        try:
            template = self._of[kind]
        except KeyError:
            recipe: dict[str, Any] = {}
            job = _build(app, settings, task, args, kwargs, options, recipe)
            self._keep.append((app, task))
            template = self._of[kind] = _Template.make(app, settings, job, recipe)
            if template is not None:
                template.add_json(job, self.json_of)
            return job
        planned = None if template is None else template.plan(
            args, kwargs, options.get("idempotency_key"))
        return planned if planned is not None else _build(
            app, settings, task, args, kwargs, options)


def _kind(app: Any, task: Any, options: dict[str, Any]) -> tuple[Any, ...] | None:
    """The key of the jobs that share a template with this one; None: _build only."""
    for name, value in options.items():
        if name not in _TEMPLATE_OPTIONS and (value is not None or name not in OPTIONS):
            return None  # a per-job option (or an unknown one, which _build refuses)
    queue = options.get("queue")
    priority = options.get("priority")
    max_attempts = options.get("max_attempts")
    key = options.get("idempotency_key")
    # exact types: True == 1 as a dict key, but is refused as a priority or max_attempts
    if not ((queue is None or type(queue) is str) and (priority is None or type(priority) is int)
            and (max_attempts is None or type(max_attempts) is int)
            and (key is None or type(key) is str)):
        return None
    return (id(app), task if isinstance(task, str) else id(task), queue, priority, max_attempts,
            key is not None)


class _Template:
    """One message made by _build, and how to make its kind's other messages from it."""

    __slots__ = ("headers", "properties", "root_is_id", "serializer", "compression", "embed",
                 "check_arguments", "args_maxsize", "kwargs_maxsize", "maxlevels",
                 "max_message_size", "job", "headers_json", "properties_json", "encode_json")

    @classmethod
    def make(cls, app: Any, settings: Settings, job: NewJob,
             recipe: dict[str, Any]) -> _Template | None:
        """The template of ``job``'s kind, or None if its jobs may differ in more than the
        per-job fields (then _build makes every one of them)."""
        from celery.app.amqp import AMQP
        from celery.app.routes import MapRoute, Router

        amqp = app.amqp
        router = amqp.router
        headers = job.headers
        if not (type(amqp).as_task_v2 is AMQP.as_task_v2 and "as_task_v2" not in vars(amqp)
                and type(router) is Router
                and all(type(route) is MapRoute for route in router.routes)  # name only
                and headers.get("eta") is None and headers.get("expires") is None
                and job.run_at is None and job.expires_at is None and not job.retries
                and "expiration" not in job.properties
                and job.task_id == headers.get("id") == job.properties.get("correlation_id")):
            return None
        self = cls()
        self.job = job
        self.headers = dict(headers)
        self.root_is_id = headers.get("root_id") == job.task_id
        self.properties = dict(job.properties)
        self.serializer = recipe["serializer"]
        self.compression = recipe["compression"]
        self.embed = recipe["embed"]
        self.encode_json = _json_encoder(self.serializer)
        self.check_arguments = recipe["check_arguments"]
        self.args_maxsize = amqp.argsrepr_maxsize
        self.kwargs_maxsize = amqp.kwargsrepr_maxsize
        self.maxlevels = app.conf.task_repr_maxlevels
        self.max_message_size = settings.max_message_size
        per_job = ["id", "argsrepr", "kwargsrepr"]
        if self.root_is_id:
            per_job.append("root_id")
        if job.idempotency_key is not None:
            per_job.append("idempotency_key")
        self.headers_json = _JsonPieces.make(self.headers, per_job)
        self.properties_json = _JsonPieces.make(self.properties, ["correlation_id"])
        return self

    def plan(self, args: Any, kwargs: Any, key: str | None) -> _Planned | None:
        """This kind's message for these arguments, all but what :meth:`finish` adds; None
        where only _build can tell (an error, an unusual argument).

        Everything read from the arguments is read here, when the caller hands them over."""
        if args is None:
            args = ()
        elif type(args) is not tuple and type(args) is not list:
            return None
        if kwargs is None:
            kwargs = {}
        elif type(kwargs) is not dict:
            return None
        if self.check_arguments is not None:
            self.check_arguments(*args, **kwargs)  # TypeError for arguments the task cannot take
        # as in as_task_v2
        args = args or ()
        kwargs = kwargs or {}
        argsrepr = _plain_repr(args, self.args_maxsize, self.maxlevels)
        kwargsrepr = _plain_repr(kwargs, self.kwargs_maxsize, self.maxlevels)
        try:
            if argsrepr is None:
                argsrepr = saferepr(args, self.args_maxsize, maxlevels=self.maxlevels)
            if kwargsrepr is None:
                kwargsrepr = saferepr(kwargs, self.kwargs_maxsize, maxlevels=self.maxlevels)
        except Exception:  # noqa: BLE001 - e.g. an int too long for str(): _build's MessageError
            return None
        if not (_plain(argsrepr) and _plain(kwargsrepr)) or (
                key is not None and not (type(key) is str and _plain(key)
                                         and len(key.encode()) <= MAX_ID_BYTES)):
            return None  # escaped or refused by _build (message_to_job)
        if self.encode_json is not None:
            try:
                body = self.encode_json((args, kwargs, self.embed))
            except Exception:  # noqa: BLE001 - _build raises kombu's EncodeError for it
                return None
            content_type, content_encoding = "application/json", "utf-8"
        else:
            content_type, content_encoding, body = dumps((args, kwargs, self.embed),
                                                         serializer=self.serializer)
        if self.compression:
            body = compress(body, self.compression)[0]
        if isinstance(body, str):
            body = body.encode("utf-8")
        elif type(body) is not bytes:
            return None
        if len(body) > self.max_message_size:
            return None  # _build raises message_to_job's error for it
        return (self, body, content_type, content_encoding, argsrepr, kwargsrepr, key)

    def finish(self, planned: _Planned, json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> NewJob:
        """The message :meth:`plan` planned (what _build would return, but for the random
        ids); its jsonb values go to ``json_of``."""
        _, body, content_type, content_encoding, argsrepr, kwargsrepr, key = planned
        task_id = _task_id()
        headers = self.headers.copy()
        headers["id"] = task_id
        if self.root_is_id:
            headers["root_id"] = task_id
        headers["argsrepr"] = argsrepr
        headers["kwargsrepr"] = kwargsrepr
        if key is not None:
            headers["idempotency_key"] = key
        properties = self.properties.copy()
        properties["correlation_id"] = task_id
        job = self.job
        made = NewJob(
            id=uuid6.uuid7(), queue=job.queue, body=body, content_type=content_type,
            content_encoding=content_encoding, headers=headers, properties=properties,
            exchange=job.exchange, routing_key=job.routing_key, task=job.task, task_id=task_id,
            retries=0, priority=job.priority, max_attempts=job.max_attempts, run_at=None,
            expires_at=None, idempotency_key=key)
        self.add_json(made, json_of)
        return made

    def add_json(self, job: NewJob, json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> None:
        """Put ``job``'s (one of this kind's) headers and properties as jsonb in ``json_of``
        (not for a job whose own values had to be escaped: its dicts are sent then)."""
        if (self.headers_json is not None and self.properties_json is not None
                and all(_plain(job.headers[key]) for key in self.headers_json.keys)
                and _plain(job.properties["correlation_id"])):
            json_of[job.id] = (self.headers_json.fill(job.headers),
                               self.properties_json.fill(job.properties))


class _JsonPieces:
    """A dict's JSON text cut around the values of some of its keys, all strings: the JSON of
    a copy that differs only in those values is the pieces joined with their JSON strings.

    jsonb keeps no text: what PostgreSQL stores is the same as for ``json.dumps`` of the copy.
    """

    __slots__ = ("format", "keys")

    _MARK = "\x00pgbroker:{}\x00"

    @classmethod
    def make(cls, value: dict[str, Any], keys: list[str]) -> _JsonPieces | None:
        """None if ``value`` has no JSON text of its own (psycopg's dumper then decides)."""
        probe = dict(value)
        for index, key in enumerate(keys):
            probe[key] = cls._MARK.format(index)
        try:
            text = json.dumps(probe)
        except (TypeError, ValueError):
            return None
        found = []
        for index, key in enumerate(keys):
            mark = json.dumps(cls._MARK.format(index))
            at = text.find(mark)
            if at < 0 or text.find(mark, at + 1) >= 0:
                return None
            found.append((at, len(mark), key))
        self = cls()
        pieces, self.keys, start = [], [], 0
        for at, length, key in sorted(found):
            pieces.append(text[start:at].replace("%", "%%"))
            self.keys.append(key)
            start = at + length
        pieces.append(text[start:].replace("%", "%%"))
        if not all(_plain_json(piece) for piece in pieces):
            return None  # something in it needs escaping (pgbroker._text): jsonb_dumps then
        self.format = "\x01" + "%s".join(pieces)
        return self

    def fill(self, value: dict[str, Any]) -> bytes:
        """The jsonb binary value (version byte 1, then the text) of ``value``."""
        return (self.format % tuple([_json_string(value[key]) for key in self.keys])).encode()


def _plain(text: Any) -> bool:
    """A string stored as it is, not escaped (pgbroker._text)."""
    return type(text) is str and storable(text) and not text.startswith(ESCAPED)


def _plain_json(text: str) -> bool:
    """JSON text with no string in it that may need escaping (as pgbroker._text.jsonb_dumps
    tells them: no \\u0000, no \\udXXX, no ESCAPED)."""
    return "\\u0000" not in text and "\\ud" not in text and ESCAPED not in text


def _json_encoder(serializer: Any) -> Any:
    """For kombu's own json serializer, the ``encode`` of a ``JSONEncoder`` kept for the batch:
    what ``dumps(data, serializer="json")`` returns as the body, without making an encoder and
    its arguments per call (``json.dumps(data, cls=JSONEncoder)`` makes one with the same
    defaults). None for any other serializer: kombu's ``dumps`` then."""
    from kombu.serialization import registry
    from kombu.utils import json as kombu_json

    codec = registry._encoders.get(serializer) if serializer == "json" else None
    if (codec is None or codec.encoder is not kombu_json.dumps
            or (codec.content_type, codec.content_encoding) != ("application/json", "utf-8")
            or kombu_json.dumps.__defaults__ != (json.dumps, kombu_json.JSONEncoder, None)):
        return None
    return kombu_json.JSONEncoder().encode


def _task_id() -> str:
    """What kombu's ``uuid()`` makes, ``str(uuid.uuid4())``, without the UUID object."""
    data = bytearray(os.urandom(16))
    data[6] = data[6] & 0x0F | 0x40  # version 4
    data[8] = data[8] & 0x3F | 0x80  # variant RFC 4122
    hex_ = data.hex()
    return f"{hex_[:8]}-{hex_[8:12]}-{hex_[12:16]}-{hex_[16:20]}-{hex_[20:]}"


def _plain_repr(value: Any, maxsize: Any, maxlevels: Any) -> str | None:
    """``saferepr(value, maxsize, maxlevels=maxlevels)`` where it is provably the same string,
    else None (then call saferepr).

    Only None, bool, int, float, str and tuples, lists and dicts (with str keys) of them, of the
    exact types, nested less deep than ``maxlevels``: saferepr writes those as ``str()`` of a
    number, a string in single quotes with only ``'`` escaped, the containers as ``repr`` does;
    and it cuts nothing from a result shorter than ``maxsize``.
    """
    if type(maxlevels) is not int or not (maxsize is None or type(maxsize) is int):
        return None
    parts: list[str] = []
    try:
        if not _plain_repr_parts(value, parts, 0, maxlevels or _PLAIN_REPR_LEVELS):
            return None
    except ValueError:  # an int too long for str(): saferepr's own error, or not
        return None
    text = "".join(parts)
    if maxsize is not None and len(text) >= maxsize:
        return None
    return text


def _plain_repr_parts(value: Any, out: list[str], level: int, maxlevels: int) -> bool:
    kind = type(value)
    if kind is str:
        out.append("'" + value.replace("'", "\\'") + "'")
    elif kind is int or kind is float or kind is bool:
        out.append(str(value))
    elif value is None:
        out.append("None")
    elif kind is tuple or kind is list or kind is dict:
        if level >= maxlevels:  # saferepr writes "[...]"
            return False
        if kind is dict:
            out.append("{")
            first = True
            for key, item in value.items():
                if type(key) is not str:
                    return False
                if not first:
                    out.append(", ")
                first = False
                out.append("'" + key.replace("'", "\\'") + "': ")
                if not _plain_repr_parts(item, out, level + 1, maxlevels):
                    return False
            out.append("}")
            return True
        out.append("(" if kind is tuple else "[")
        for index, item in enumerate(value):
            if index:
                out.append(", ")
            if not _plain_repr_parts(item, out, level + 1, maxlevels):
                return False
        out.append((",)" if len(value) == 1 else ")") if kind is tuple else "]")
    else:
        return False
    return True


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
    if not (type(item) is tuple or type(item) is list) and (  # (the ABC check is slow)
            isinstance(item, (str, bytes)) or not isinstance(item, Sequence)) or not (
            1 <= len(item) <= 4):
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


def _write(conn: psycopg.Connection[Any], jobs: Sequence[tuple[Settings, NewJob | _Planned]],
           batch_size: int, json_of: dict[uuid.UUID, tuple[bytes, bytes]] | None = None,
           ) -> list[uuid.UUID]:
    """Insert ``jobs`` in batches, one statement per batch and destination schema (normally
    one); a planned message is finished when its batch is made. ``json_of``: headers and
    properties already made into jsonb values, by job id.

    Inside a transaction, the batches of one schema are pipelined: the server inserts a batch
    while the next one is made and sent (a failed insert raises when the last batch is sent).
    In autocommit mode each statement stays a transaction of its own, so they go one by one.

    Returns the id of each job, in order: the one made for it, or for a duplicate (of an
    idempotency key) the existing job's.
    """
    json_of = {} if json_of is None else json_of
    pipelined = (len(jobs) > batch_size and not conn.autocommit
                 and len({settings.schema for settings, _ in jobs}) == 1)
    ids: list[uuid.UUID] = []
    duplicates: dict[uuid.UUID, uuid.UUID] = {}
    sent: list[_Sent] = []
    with contextlib.ExitStack() as stack:
        if pipelined:
            stack.enter_context(_translate(jobs[0][0]))
            stack.enter_context(conn.pipeline())
        for start in range(0, len(jobs), batch_size):
            by_schema: dict[str, tuple[Settings, list[NewJob]]] = {}
            for settings, entry in jobs[start:start + batch_size]:
                job = entry if type(entry) is NewJob else entry[0].finish(entry, json_of)
                ids.append(job.id)
                by_schema.setdefault(settings.schema, (settings, []))[1].append(job)
            for settings, batch in by_schema.values():
                if pipelined:
                    sent.append(_send_many(conn, settings, batch, json_of))
                else:
                    duplicates.update(_insert_many(conn, settings, batch, json_of))
    if sent:
        with _translate(jobs[0][0]):
            for batch_sent in sent:
                duplicates.update(_duplicates(conn, batch_sent))
    return [duplicates.get(job_id, job_id) for job_id in ids] if duplicates else ids


def _insert_many(conn: psycopg.Connection[Any], settings: Settings, jobs: list[NewJob],
                 json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> dict[uuid.UUID, uuid.UUID]:
    """``job_insert_many`` for ``jobs``; keyed jobs are then looked up in the same round trip.

    Returns {id made for a job that was a duplicate: the existing job's id}.
    """
    with _translate(settings):
        if not any(job.idempotency_key is not None for job in jobs):
            return _duplicates(conn, _send_many(conn, settings, jobs, json_of))
        # The look-up is what tells an inserted job from a duplicate: pipelined, so the batch
        # still costs one round trip.
        with conn.pipeline():
            sent = _send_many(conn, settings, jobs, json_of)
        return _duplicates(conn, sent)


#: What _send_many sent for a batch: its settings, its jobs, the insert's cursor, the digests
#: made (by job id), and the look-up of its keyed jobs (their list and its cursor) if any.
_Sent = tuple


def _send_many(conn: psycopg.Connection[Any], settings: Settings, jobs: list[NewJob],
               json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> _Sent:
    """Execute ``job_insert_many`` for ``jobs`` and, if some have idempotency keys (then in a
    pipeline), ``job_enqueued_ids`` for those."""
    q = queries(settings.schema)
    cur = conn.cursor(row_factory=tuple_row)
    digests: dict[uuid.UUID, bytes] = {}
    if isinstance(cur, ClientCursorMixin):
        # client-side binding (Django's default) writes literals: psycopg's own, from lists
        cur.execute(q["job_insert_many"], insert_many_params(jobs, settings.channel))
    else:
        for kind, dumper in _KINDS.values():
            cur.adapters.register_dumper(kind, dumper)  # the cursor's adapters only
        cur.execute(q["job_insert_many"], _columns(conn, jobs, settings.channel, json_of,
                                                   digests))
    keyed = [job for job in jobs if job.idempotency_key is not None]
    if not keyed:
        return settings, jobs, cur, digests, None
    lookup = conn.cursor(row_factory=tuple_row)
    lookup.execute(q["job_enqueued_ids"], lookup_params(keyed, digests))
    return settings, jobs, cur, digests, (keyed, lookup)


def _duplicates(conn: psycopg.Connection[Any], sent: _Sent) -> dict[uuid.UUID, uuid.UUID]:
    """{id made for a job that was a duplicate: the existing job's id}, from the look-up of the
    keyed jobs and, for the other jobs the insert skipped, one more (counting them)."""
    settings, jobs, cur, digests, keyed_lookup = sent
    skipped = {row[0] for row in cur.fetchall() if row[0] is not None}
    resolved: dict[uuid.UUID, uuid.UUID] = {}
    if keyed_lookup is not None:
        keyed, lookup = keyed_lookup
        found = lookup.fetchall()
        log_duplicates(keyed, found)
        resolved.update(_resolve(keyed, found))
    unkeyed = [job for job in jobs if job.id in skipped and job.idempotency_key is None]
    if unkeyed:  # a re-run of the same messages (the same task ids and contents)
        found = conn.cursor(row_factory=tuple_row).execute(
            queries(settings.schema)["job_enqueued_ids"],
            lookup_params(unkeyed, digests)).fetchall()
        log_duplicates(unkeyed, found)
        resolved.update(_resolve(unkeyed, found))
    return {made: job_id for made, job_id in resolved.items() if made != job_id}


# -- job_insert_many's column arrays, in PostgreSQL's binary array format -----------------------
#
# psycopg dumps a list element by element in Python, and a Jsonb with json.dumps: for a batch of
# 1000 jobs that is about as long as the statement itself. Here each column is one binary array
# made by joining its elements (the same element made once for a value repeated down the column),
# and a job made from a template brings its headers and properties as jsonb values already. A
# column this cannot make exactly as psycopg would (a time, an int out of range, a dict without
# its jsonb value) is left to psycopg, as a list.

_ARRAY_HEADER = struct.Struct(">iiiii")  # dimensions, has nulls, element oid, length, lower bound
_LENGTH = struct.Struct(">i").pack
_NULL = _LENGTH(-1)
_INT2 = struct.Struct(">h").pack
_INT4 = struct.Struct(">i").pack


class _Array(bytes):
    """A column of values as a PostgreSQL binary array (``_array_kind`` makes its kinds)."""

    __slots__ = ()
    element_oid = 0


def _array_kind(name: str) -> tuple[type[_Array], type[Dumper]]:
    info = psycopg.postgres.types[name]
    kind = type(f"_Array_{name}", (_Array,), {"__slots__": (), "element_oid": info.oid})
    dumper = type(f"_ArrayDumper_{name}", (Dumper,), {
        "format": Format.BINARY, "oid": info.array_oid, "dump": lambda self, obj: obj})
    return kind, dumper


_KINDS = {name: _array_kind(name)
          for name in ("uuid", "text", "int2", "int4", "bytea", "jsonb", "timestamptz")}
_TEXT_COLUMNS = ("queue", "task", "task_id", "exchange", "routing_key", "content_type",
                 "content_encoding", "idempotency_key")


def _array(name: str, elements: list[bytes], has_null: bool = False) -> _Array:
    """``elements`` (each its length then its bytes, or _NULL) as an array of type ``name``."""
    kind = _KINDS[name][0]
    return kind(_ARRAY_HEADER.pack(1, has_null, kind.element_oid, len(elements), 1)
                + b"".join(elements))


def _text_array(values: list[Any]) -> _Array | list[Any]:
    made: dict[str | None, bytes] = {None: _NULL}
    elements = []
    for value in values:
        if value is not None and type(value) is not str:
            return values  # psycopg's dumper
        element = made.get(value)
        if element is None:
            data = value.encode()
            element = made[value] = _LENGTH(len(data)) + data
        elements.append(element)
    return _array("text", elements, None in values)


def _int_array(name: str, values: list[int]) -> _Array | list[int]:
    pack, low, high = (_INT2, -2**15, 2**15 - 1) if name == "int2" else (_INT4, -2**31, 2**31 - 1)
    made: dict[int, bytes] = {}
    elements = []
    for value in values:
        if type(value) is not int:  # a bool (True == 1) or other: as psycopg sends it
            return values
        element = made.get(value)
        if element is None:
            if not low <= value <= high:
                return values  # psycopg's dumper, and PostgreSQL's error
            element = made[value] = _LENGTH(len(pack(value))) + pack(value)
        elements.append(element)
    return _array(name, elements)


def _columns(conn: psycopg.Connection[Any], jobs: list[NewJob], channel: str,
             json_of: dict[uuid.UUID, tuple[bytes, bytes]],
             digests: dict[uuid.UUID, bytes]) -> dict[str, Any]:
    """``job_insert_many``'s parameters for ``jobs``: what ``insert_many_params`` gives, with
    the columns as binary arrays. The message digests made go to ``digests``."""
    encoding = conn.info.encoding
    sixteen = _LENGTH(16)
    params: dict[str, Any] = {
        "id": _array("uuid", [sixteen + job.id.bytes for job in jobs]),
        "body": _array("bytea", [_LENGTH(len(job.body)) + job.body for job in jobs]),
        "retries": _int_array("int4", [job.retries for job in jobs]),
        "priority": _int_array("int2", [job.priority for job in jobs]),
        "max_attempts": _int_array("int4", [job.max_attempts for job in jobs]),
        "channel": channel,
    }
    for name in _TEXT_COLUMNS:
        values = [getattr(job, name) for job in jobs]
        # psycopg's dumper for another client encoding (and its error for a character that
        # has no code in it); SQL_ASCII ("ascii") is sent UTF-8, as psycopg does
        params[name] = _text_array(values) if encoding in ("utf-8", "ascii") else values
    for name in ("run_at", "expires_at"):
        values = [getattr(job, name) for job in jobs]
        # times: psycopg's dumper, unless all are NULL
        params[name] = values if any(v is not None for v in values) else _array(
            "timestamptz", [_NULL] * len(values), True)
    made = [json_of.pop(job.id, None) for job in jobs]  # each job is sent once: let them go
    if None in made:
        values = [job.jsonb() for job in jobs]
        params["headers"] = [headers for headers, _ in values]
        params["properties"] = [properties for _, properties in values]
        digests.update((job.id, job.digest()) for job in jobs)
    else:
        params["headers"] = _array("jsonb", [_LENGTH(len(h)) + h for h, _ in made])
        params["properties"] = _array("jsonb", [_LENGTH(len(p)) + p for _, p in made])
        # the jsonb values are a version byte and json.dumps' text: the digest's input
        digests.update((job.id, message_digest(job, h[1:], p[1:]))
                       for job, (h, p) in zip(jobs, made))
    params["message_digest"] = _array(
        "bytea", [_LENGTH(32) + digests[job.id] for job in jobs])
    return params


def _resolve(jobs: list[NewJob], found: list[tuple[Any, Any]]) -> dict[uuid.UUID, uuid.UUID]:
    """{id made: id of the job it ended up as}, from ``job_enqueued_ids``'s answer.

    None means the duplicate was deleted (pruned, purged) between the insert and the look-up: a
    race of microseconds, reported rather than retried, since the caller's transaction already
    holds the rest of its work.
    """
    resolved: dict[uuid.UUID, uuid.UUID] = {}
    for job, (job_id, _) in zip(jobs, found, strict=True):
        if job_id is None:
            raise RuntimeError(f"pgbroker: the job duplicating {job.task!r} (key "
                               f"{job.idempotency_key!r}) was deleted during the insert; "
                               "enqueue it again")
        resolved[job.id] = job_id
    return resolved


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
