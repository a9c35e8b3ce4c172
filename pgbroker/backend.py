"""pgbroker result backend: Celery task results in PostgreSQL, and chords without polling.

Features
========
* Results in their own tables of the pgbroker schema (``results``, ``result_groups``,
  ``result_chords``), never in the ``jobs`` row; ``result_extended`` fields in columns.
* ``AsyncResult.get()`` is woken by LISTEN/NOTIFY on the channel ``<schema>.results`` (payload:
  the task id), not by polling. Waiters still re-read what they wait for every ``poll_interval``
  seconds, in case a notification was lost (PgBouncer transaction pooling does not carry LISTEN).
* Chords count their header tasks with an atomic counter (one upsert per finished header task,
  each task counted once even when it runs twice) and the task that completes the count
  publishes the callback: no ``celery.chord_unlock`` task ever polls.
* ``result_expires`` (and ``result_failure_expires``): an expired result is invisible at once and
  deleted by :meth:`DatabaseBackend.cleanup` in small batches (Celery beat schedules it daily
  as ``celery.backend_cleanup``).

Connection String
=================
.. code-block:: python

    result_backend = "pgbroker://USER:PASSWORD@HOST:PORT/DBNAME"
    result_backend = "pgbroker+postgresql://USER:PASSWORD@HOST:PORT/DBNAME"

The ``pgbroker`` alias comes from the ``celery.result_backends`` entry point (setup.cfg). Without
the installed entry point, name the class: ``"pgbroker.backend:DatabaseBackend+postgresql://..."``.

Transport Options
=================
``result_backend_transport_options`` takes the broker's options (:class:`pgbroker.Settings`,
validated alike: unknown options are an error) and reads ``schema`` (default: the broker's
``schema`` option when the broker is pgbroker, else ``"pgbroker"``), ``auto_migrate`` (True),
``connect_timeout`` (10 s), ``poll_interval`` (5 s: the waiters' safety re-read) and
``prune_batch_size`` (1000 rows per clean-up statement). Isolate applications by schema: Celery's
``global_keyprefix`` is refused as an unknown option.

Limits
======
* One connection per process for reads and writes (psycopg serialises threads on it), plus one
  LISTEN connection in processes that wait on results. Both are reopened after ``fork()``.
* The chord callback is published by the worker that finished the last header task, after the
  header results are written and outside their transaction. If that worker dies between its
  claim and the publish, the next run of a header task (acks_late redelivery) re-claims the
  callback once the claim is older than ``max(10, 2 * result_chord_join_timeout)`` seconds; a
  callback published twice that way is deduplicated by the pgbroker broker (same task id), not
  by another broker.
* Storing a result and acking its job in one transaction is not done (see below).
* A result write whose statement fails on a living connection (disk full, a lock or statement
  timeout) is tried a few times, a short pause apart (pgbroker._pg.retry), before the worker acks
  the task. A success that still cannot be stored is
  recorded in its job row (pgbroker._celery.failures), so that the ack ends the job ``dead`` with
  "the task succeeded but its result could not be stored: <SQLSTATE> <message>", and
  :class:`pgbroker.errors.JobDead` is raised to Celery. A task id with no stored result whose
  job is ``dead`` reads as that FAILURE (the job's ``last_error``), never PENDING for ever; a
  waiter reads it at its next re-read (``poll_interval``): no NOTIFY says so.

Result and ack in one transaction (not implemented)
===================================================
Today the result is committed by the pool process, then the job is acked (``job_ack``) by the
worker's main process: a crash in between redelivers a task whose SUCCESS is stored (and kept:
a stored SUCCESS is never overwritten). Doing both at once would need: an opt-in option (the
broker and the backend must share the database and schema); the delivery's identity, which the
transport already puts in ``request.delivery_info`` (``pgbroker_job_id``, ``pgbroker_attempt``);
``_store_result`` running ``result_set`` and the core ``job_ack`` (``job_ack_delete`` when the
broker's ``retention`` is 0) in one ``conn.transaction()``, for SUCCESS always and for FAILURE
only when ``task_acks_on_failure_or_timeout`` is on, and only with ``task_acks_late``; the later
ack from the main process then matches no ``running`` row and changes nothing, as today.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from time import monotonic
from typing import Any, NamedTuple

import celery
import psycopg
from celery import states
from celery.backends.asynchronous import AsyncBackendMixin, BaseResultConsumer
from celery.backends.base import BaseKeyValueStoreBackend
from celery.canvas import maybe_signature
from celery.exceptions import BackendStoreError, ChordError
from celery.result import GroupResult, allow_join_result
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps as json_dumps

from ._celery.failures import record_unstored_result
from ._model.message import MAX_ID_BYTES, aware
from ._model.text import ESCAPED, escape, escape_json, storable
from ._pg import driver as _db
from ._pg.catalogue import Queries
from ._pg.retry import TRIES, retried, statement_failure
from ._pg.session import Session
from .errors import ConfigurationError, DatabaseUnavailable, JobDead
from .settings import Settings

__all__ = ["DatabaseBackend", "ResultConsumer"]

logger = logging.getLogger(__name__)

#: Celery before 5.7 fulfils only the first result object of a task id (see on_state_change).
_FULFILS_ONE = celery.VERSION < (5, 7)


class ChordPart(NamedTuple):
    """What ``result_chord_part_return`` says about a chord after counting one header task."""

    done: int
    total: int | None
    claimed: bool
    dispatched: bool


class DatabaseBackend(BaseKeyValueStoreBackend, AsyncBackendMixin):
    """Celery result backend over PostgreSQL (see the module docstring)."""

    #: Counts chord parts atomically: Celery takes the ``on_chord_part_return`` path and never
    #: sends ``celery.chord_unlock``.
    implements_incr = True
    supports_native_join = True
    #: Expiry needs :meth:`cleanup`: beat schedules ``celery.backend_cleanup`` for it.
    supports_autoexpire = False
    supports_result_compression = True  # bytea keeps any bytes
    supports_failure_expires = True
    persistent = True

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any):
        super().__init__(app, url=url, **kwargs)
        conf = self.app.conf
        failure_expires = conf.get("result_failure_expires")
        self.failure_expires = (self.expires if failure_expires is None
                                else self.prepare_expires(failure_expires))
        broker_url = str(conf.broker_url or "")
        if not url:
            if not broker_url.startswith("pgbroker"):
                raise ConfigurationError(
                    "the pgbroker result backend needs a database URL: "
                    "result_backend = 'pgbroker://user@host/dbname'")
            url = broker_url
        self.url = url
        default_schema = None
        if broker_url.startswith("pgbroker"):
            default_schema = (conf.broker_transport_options or {}).get("schema")
        options = dict(conf.get("result_backend_transport_options") or {})
        if default_schema and "schema" not in options:
            options["schema"] = default_schema
        #: The broker's option set, validated alike (unknown options are an error); the backend
        #: reads schema, auto_migrate, connect_timeout, poll_interval and prune_batch_size.
        self.options = Settings.from_options(options)
        self.channel = f"{self.options.schema}.results"
        self.conninfo = _db.libpq_url(url)
        self.q = Queries(self.options.schema)
        self.connection_errors = _db.CONNECTION_ERRORS
        # Celery 5.7's chord_expires and _chord_result_expires, here because 5.4-5.6 have neither:
        # the chord counter lives result_chord_expires (else result_expires), the header
        # results at least result_expires (0: no expiry)
        chord = conf.get("result_chord_expires")
        self.chord_ttl = self.expires if chord is None else self.prepare_expires(chord, type=int)
        self.chord_keep = (max(self.chord_ttl, self.expires) if self.chord_ttl and self.expires
                           else 0)
        join_timeout = conf.result_chord_join_timeout or 5.0
        self.chord_reclaim_after = timedelta(seconds=max(10.0, 2 * float(join_timeout)))
        # The session owns connecting (migrating or checking the schema first, reopening after
        # fork) and the policy of every statement, as for the broker's own
        self._session = Session(self.conninfo, self.options, application_name="pgbroker results")
        self.result_consumer = ResultConsumer(self, self.app, self.accept,
                                              self._pending_results, self._pending_messages)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return super().__reduce__(args, dict(kwargs or {}, url=self.url))

    def as_uri(self, include_password: bool = False) -> str:
        return self.url if include_password else _db.mask_password(self.url)

    def close(self) -> None:
        """Close this process's connections (they reopen on next use)."""
        self.result_consumer.stop()
        self._session.close()

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """Connection losses are retried when ``result_backend_always_retry`` is on."""
        return isinstance(exc, self.connection_errors)

    # -- statements ------------------------------------------------------------------------------

    def _run(self, name: str, params: Mapping[str, Any], *, retry: bool = True
             ) -> psycopg.Cursor[Any]:
        """Run one named statement (its own transaction). A connection found broken (a database
        restart since the last use) is replaced and the statement sent once more when ``retry``
        (every statement is idempotent but ``incr``)."""
        while True:
            conn = self._session.conn
            try:
                return self._session.execute(name, dict(params), binary=True,
                                             what=f"pgbroker result backend ({name})")
            except DatabaseUnavailable:
                if not (conn.broken or conn.closed):
                    raise
                self._session.close()
                if not retry:
                    raise
                retry = False

    def _split_key(self, key: str | bytes) -> tuple[str, str]:
        """("task" | "group" | "chord", id) of a key made by ``get_key_for_*``."""
        raw = self.key_t(key)
        for kind, prefix in (("task", self.task_keyprefix), ("group", self.group_keyprefix),
                             ("chord", self.chord_keyprefix)):
            if raw.startswith(prefix):
                return kind, bytes_to_str(raw[len(prefix):])
        raise ValueError(f"pgbroker result backend: {bytes_to_str(raw)!r} is not a task, "
                         "group or chord key")

    # -- the key/value interface -----------------------------------------------------------------

    def get(self, key: str | bytes) -> bytes | None:
        kind, ident = self._split_key(key)
        if kind == "task":
            row = self._run("result_get", {"task_id": ident}).fetchone()
            if row is None:
                return self._dead({ident}).get(ident)
        elif kind == "group":
            row = self._run("result_group_get", {"group_id": ident}).fetchone()
        else:
            row = self._run("result_chord_get", {"group_id": ident}).fetchone()
            return None if row is None else str(row[0]).encode()
        return None if row is None else bytes(row[0])

    def mget(self, keys: Iterable[str | bytes]) -> list[bytes | None]:
        keys = list(keys)
        split = [self._split_key(k) for k in keys]
        found = self._payloads({ident for kind, ident in split if kind == "task"})
        return [found.get(ident) if kind == "task" else self.get(key)
                for key, (kind, ident) in zip(keys, split)]

    def _payloads(self, task_ids: Iterable[str]) -> dict[str, bytes]:
        """The stored payloads of these task ids (one statement)."""
        ids = list(task_ids)
        if not ids:
            return {}
        rows = self._run("result_get_many", {"task_ids": ids}).fetchall()
        found = {task_id: bytes(payload) for task_id, payload in rows}
        missing = set(ids) - found.keys()
        return {**found, **self._dead(missing)} if missing else found

    def _dead(self, task_ids: Iterable[str]) -> dict[str, bytes]:
        """The FAILURE payloads (:class:`JobDead`, with the job's reason) of these task ids
        whose job is ``dead`` with no result stored (result_job_dead)."""
        rows = self._run("result_job_dead", {"task_ids": list(task_ids)}).fetchall()
        found = {}
        for task_id, reason in rows:
            meta = self._get_result_meta(
                result=self.encode_result(JobDead(reason), states.FAILURE),
                state=states.FAILURE, traceback=None, request=None)
            found[task_id] = _bytes(self.encode({**meta, "task_id": task_id}))
        return found

    def set(self, key: str | bytes, value: str | bytes, expires: float | None = None) -> None:
        kind, ident = self._split_key(key)
        expires = self.expires if expires is None else expires
        if kind == "task":
            self._set_task(ident, value, self.decode(value), expires)
        elif kind == "group":
            self._run("result_group_set", {"group_id": ident, "payload": _bytes(value),
                                           "content_type": self.content_type,
                                           "ttl": _ttl(expires)})
        else:
            raise ValueError("chord counters are changed with incr(), not set()")

    def _set_with_state(self, key: str | bytes, value: str | bytes, state: str) -> None:
        if state == states.FAILURE:
            return self.set(key, value, expires=self.failure_expires)
        return self.set(key, value)

    def delete(self, key: str | bytes) -> None:
        kind, ident = self._split_key(key)
        name = {"task": "result_delete", "group": "result_group_delete",
                "chord": "result_chord_delete"}[kind]
        self._run(name, {"task_id" if kind == "task" else "group_id": ident})

    def incr(self, key: str | bytes) -> int:
        kind, ident = self._split_key(key)
        if kind != "chord":
            raise ValueError(f"only chord counters can be incremented, not a {kind} key")
        row = self._run("result_chord_incr", {"group_id": ident}, retry=False).fetchone()
        assert row is not None  # the statement returns the counter
        return int(row[0])

    def expire(self, key: str | bytes, value: float | None) -> None:
        kind, ident = self._split_key(key)
        name = {"task": "result_expire", "group": "result_group_expire",
                "chord": "result_chord_expire"}[kind]
        self._run(name, {"task_id" if kind == "task" else "group_id": ident, "ttl": _ttl(value)})

    # -- task results ----------------------------------------------------------------------------

    def _store_result(self, task_id: str, result: Any, state: str, traceback: str | None = None,
                      request: Any = None, **kwargs: Any) -> Any:
        # Celery's generic version reads the stored state first and writes after; here the
        # "never overwrite a SUCCESS" rule is part of the one upsert (result_set).
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = bytes_to_str(task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        payload = self.encode(meta)
        try:
            retried(lambda: self._set_task(meta["task_id"], payload, meta, expires),
                    f"storing the {state} of task {task_id}")
        except psycopg.errors.ProgramLimitExceeded as exc:
            raise BackendStoreError(f"result too large for PostgreSQL: {exc}", state=state,
                                    task_id=task_id) from exc
        except Exception as exc:
            failure = statement_failure(exc)
            if state != states.SUCCESS or failure is None:
                raise  # a lost connection (Celery's result_backend_always_retry), bad data
            reason = f"the task succeeded but its result could not be stored: {failure}"
            logger.error("pgbroker result backend: task %s: %s (%d tries)", task_id, reason,
                         TRIES)
            record_unstored_result(self.app, request, reason)
            raise JobDead(reason) from exc
        return result

    def _set_task(self, task_id: str, payload: str | bytes, meta: Mapping[str, Any],
                  expires: float | None) -> None:
        if not storable(task_id) or len(task_id.encode()) > MAX_ID_BYTES:
            raise ValueError(f"task id {task_id[:80]!r} cannot be a key of PostgreSQL's results "
                             f"table: it holds a NUL or a surrogate, or is over {MAX_ID_BYTES} "
                             "bytes")
        self._run("result_set", {
            "task_id": task_id,
            "status": meta["status"],
            "payload": _bytes(payload),
            "content_type": self.content_type,
            "result": _json_or_none(meta.get("result")),
            "traceback": _text(meta.get("traceback")),
            "date_done": _timestamp(meta.get("date_done")),
            "name": _text(meta.get("name")),
            "args": _json_or_none(meta.get("args")),
            "kwargs": _json_or_none(meta.get("kwargs")),
            "worker": _text(meta.get("worker")),
            "retries": meta.get("retries") if isinstance(meta.get("retries"), int) else None,
            "queue": _text(meta.get("queue")),
            "group_id": _text(meta.get("group_id")),
            "parent_id": _text(meta.get("parent_id")),
            "ttl": _ttl(expires),
            "channel": self.channel,
        })

    def on_task_call(self, producer: Any, task_id: str) -> None:
        """Nothing to subscribe at publish: a waiter listens when it starts waiting, and reads
        the result once after LISTEN, so nothing stored in between is missed."""

    # -- chords ----------------------------------------------------------------------------------

    def _apply_chord_incr(self, header_result_args: Any, body: Any, **kwargs: Any) -> None:
        # Runs before any header task is published: a frozen chord applied again reuses its
        # group id, and must not inherit the earlier run's counter or "dispatched" marker.
        group_id = header_result_args[0]
        self._run("result_chord_delete", {"group_id": group_id})
        super()._apply_chord_incr(header_result_args, body, **kwargs)

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        self._run("result_chord_size_set", {"group_id": group_id, "size": chord_size,
                                            "ttl": _ttl(self.chord_ttl)})

    def add_to_chord(self, group_id: str, result: Any) -> None:
        self._run("result_chord_add", {"group_id": group_id}, retry=False)

    def _chord_part(self, request: Any, size: int | None, token: uuid.UUID) -> ChordPart:
        index = request.group_index
        row = self._run("result_chord_part_return", {
            "group_id": request.group, "task_id": request.id,
            "group_index": index if isinstance(index, int) else -1, "size": size,
            "token": token, "ttl": _ttl(self.chord_ttl),
            "keep": _ttl(self.chord_keep),
            "reclaim_after": self.chord_reclaim_after,
        }).fetchone()
        assert row is not None  # the statement returns the chord's counts
        return ChordPart(int(row[0]), None if row[1] is None else int(row[1]), bool(row[2]),
                         bool(row[3]))

    def on_chord_part_return(self, request: Any, state: str, result: Any,
                             **kwargs: Any) -> None:
        """Count a finished header task; the one that completes the chord publishes the body."""
        gid = request.group
        if not gid or not request.chord:
            return
        app = self.app
        callback = maybe_signature(request.chord, app=app)
        token = uuid.uuid4()
        part = self._chord_part(request, request.chord.get("chord_size"), token)
        if part.total is None and not part.dispatched:
            # Celery did not tell the size (set_chord_size): the saved header knows it.
            deps = GroupResult.restore(gid, backend=self)
            if deps is None:
                self._fail_chord(gid, callback, ChordError(f"GroupResult {gid} no longer exists"))
                return
            part = self._chord_part(request, len(deps), token)
        if part.dispatched or not part.claimed:
            return
        try:
            self._dispatch_chord(gid, callback)
        finally:
            self._run("result_chord_dispatched", {"group_id": gid, "token": token})

    def _dispatch_chord(self, gid: str, callback: Any) -> None:
        """Join the header (every result is stored by now) and publish the callback.

        The saved header group is kept (it expires with the chord), so that a take-over of a
        stale claim can join it again.
        """
        app = self.app
        deps = GroupResult.restore(gid, backend=self)
        if deps is None:
            self._fail_chord(gid, callback, ChordError(f"GroupResult {gid} no longer exists"))
            return
        try:
            with allow_join_result():
                ret = deps.join_native(timeout=app.conf.result_chord_join_timeout,
                                       propagate=True)
        except Exception as exc:  # noqa: BLE001 - any header failure fails the chord
            culprit = next(deps._failed_join_report(), None)
            reason = f"Dependency {culprit.id} raised {exc!r}" if culprit else repr(exc)
            self._fail_chord(gid, callback,
                             _chord_error(reason, exc))
            return
        try:
            # Celery 5.7's publish with waits between retries; before it, a plain publish
            getattr(app.amqp, "_retry_publish", _call)(callback.delay, ret)
        except Exception as exc:  # noqa: BLE001 - the body is failed, never left waiting
            self._fail_chord(gid, callback, _chord_error(f"Callback error: {exc!r}", exc))

    def _fail_chord(self, gid: str, callback: Any, exc: ChordError) -> Any:
        """Mark the body failed and call its errbacks (Celery's ``chord_error_from_stack``,
        which reads the exception being handled: hence the raise)."""
        logger.error("Chord %r failed: %s", gid, exc)
        try:
            raise exc
        except ChordError:
            return self.chord_error_from_stack(callback, exc)

    # -- expiry ----------------------------------------------------------------------------------

    def cleanup(self, now: datetime | None = None) -> int:
        """Delete expired results, groups and chord counters in small batches; return how many.

        Celery beat runs it daily as ``celery.backend_cleanup``. ``now`` lets tests move the
        clock instead of sleeping.
        """
        limit = self.options.prune_batch_size
        total = 0
        for name in ("result_cleanup", "result_group_cleanup", "result_chord_cleanup"):
            while True:
                cur = self._run(name, {"now": now, "limit": limit})
                row = cur.fetchone() if cur.description else None
                deleted = int(row[0]) if row else cur.rowcount
                total += deleted
                if deleted < limit:
                    break
        if total:
            logger.info("pgbroker result backend: deleted %d expired row(s)", total)
        return total


class ResultConsumer(BaseResultConsumer):
    """Wakes ``AsyncResult.get()`` waiters with LISTEN/NOTIFY.

    One LISTEN connection per process, opened when a waiter first has to wait. Every
    notification carries a task id; the ids someone waits for are read back in one statement.
    Right after LISTEN (first use, reconnect) and every ``poll_interval`` seconds, all pending
    ids are re-read: a result stored before LISTEN, or whose notification was lost, is found.
    """

    backend: DatabaseBackend

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._subscribed: set[str] = set()
        self._listener: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._last_read = monotonic()

    def start(self, initial_task_id: str, **kwargs: Any) -> None:
        self.consume_from(initial_task_id)

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        _db.close(listener)

    def on_after_fork(self) -> None:
        self._forget_parent()
        super().on_after_fork()

    def _forget_parent(self) -> None:
        """In a forked child: the LISTEN connection is the parent's (``_db.close`` leaves it
        alone), and the lock may be held by a parent thread that did not survive the fork.
        Celery does not call ``on_after_fork`` for every backend, so draining checks too.
        The ids waited for are kept: the child may have added its own before its first drain."""
        self._pid = os.getpid()
        self._listener = None
        self._lock = threading.Lock()

    # set.add/discard are atomic: no lock, so that AsyncResult.__del__ (garbage collection, in
    # any thread, maybe while this thread drains) can never block.
    def consume_from(self, task_id: str) -> None:
        self._subscribed.add(task_id)

    def cancel_for(self, task_id: str) -> None:
        self._subscribed.discard(task_id)

    def on_state_change(self, meta: dict[str, Any], message: Any) -> None:
        ready = meta["status"] in states.READY_STATES
        # Celery before 5.7 fulfils one result object per task id, the first registered; a
        # second one (a group restored for a chord's join while the first lives) waiting in
        # join_native's buckets would wait until its timeout. Celery 5.7 fulfils them all.
        waiting = ([node for node in list(self.buckets) if node.id == meta["task_id"]]
                   if ready and _FULFILS_ONE and self.buckets else [])
        super().on_state_change(meta, message)
        if ready:
            self.cancel_for(meta["task_id"])
            for node in waiting:
                if not node._cache:
                    node._maybe_set_cache(meta)

    def on_wait_for_pending(self, result: Any, **kwargs: Any) -> None:
        """Read the results once before waiting: those already stored resolve at once."""
        for meta in result._iter_meta(**kwargs):
            if meta is not None:
                self.on_state_change(meta, None)
                if meta["status"] in (states.SUCCESS, states.FAILURE):
                    # on_state_change buffers a meta nobody waits for (resolved already):
                    # nothing will ever take it, so drop it (as Celery's Redis backend does).
                    buffered = self.backend._pending_messages
                    try:
                        taken = buffered.pop(meta["task_id"])
                    except KeyError:
                        pass
                    else:
                        buffered.total -= len(taken)

    def drain_events(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for notifications and resolve what they announce."""
        if self._pid != os.getpid():
            self._forget_parent()
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return  # another thread is waiting on the socket; its results are shared
        try:
            ids = self._collect(timeout)
        finally:
            self._lock.release()
        wanted = ids & self._subscribed.copy()
        if wanted:
            for payload in self.backend._payloads(wanted).values():
                self.on_state_change(self.backend.decode_result(payload), None)

    def _collect(self, timeout: float | None) -> set[str]:
        fresh = not _db.owned(self._listener)
        ids: set[str] = set()
        if fresh:
            self._listen()
        else:
            ids = self._wait(timeout)
        if fresh or monotonic() - self._last_read >= self.backend.options.poll_interval:
            self._last_read = monotonic()
            ids |= self._subscribed.copy()
        return ids

    def _listen(self) -> None:
        backend = self.backend
        _db.close(self._listener)
        self._listener = None
        self._listener = _db.listen(
            backend.conninfo, backend.channel, connect_timeout=backend.options.connect_timeout,
            application_name="pgbroker results listen", what="LISTEN for results")

    def _wait(self, timeout: float | None) -> set[str]:
        listener = self._listener
        assert listener is not None
        poll = max(self.backend.options.poll_interval, 0.1)
        wait = poll if timeout is None else min(timeout, poll)
        try:
            with _db.translate_errors("waiting for result notifications"):
                ids = set(_db.notifications(listener, _CLOSED))
                if not ids:
                    _db.wait_readable(listener.fileno(), max(wait, 0.0))
                    ids = set(_db.notifications(listener, _CLOSED))
        except (OSError, psycopg.Error) as exc:  # DatabaseUnavailable is an OSError
            # The next drain reconnects and re-reads every pending result; a database still
            # down fails that connect. Not raised: Celery before 5.7 would give the error to
            # the caller of .get() instead of draining again.
            logger.warning("results LISTEN connection lost (%s): connecting again", exc)
            self.stop()
            return set()
        return ids


#: What a closed results LISTEN connection is called in the error (see _db.notifications).
_CLOSED = "the results LISTEN connection"


def _call(function: Any, *args: Any) -> Any:
    return function(*args)


def _chord_error(message: str, cause: Exception) -> ChordError:
    """A ChordError caused by ``cause`` (what Celery 5.6's private
    ``_create_chord_error_with_cause`` makes; Celery 5.4 and 5.5 have no such helper)."""
    error = ChordError(message)
    error.__cause__ = cause
    return error


def _ttl(seconds: float | timedelta | None) -> timedelta | None:
    """Celery's expiry (seconds; None or 0: never) as the interval the statements add to now()."""
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    return timedelta(seconds=seconds) if seconds and seconds > 0 else None


def _bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def _text(value: Any) -> str | None:
    """A text column's value, escaped where PostgreSQL text cannot hold it (NUL, surrogates:
    pgbroker._model.text.unescape gives it back)."""
    if value is None:
        return None
    return escape(str(value))


def _json_or_none(value: Any) -> str | None:
    """``value`` as jsonb text, strings escaped where needed; None when it is no JSON (the
    payload keeps every result exactly)."""
    if value is None:
        return None
    try:
        text: str = json_dumps(value, allow_nan=False)
        if "\\u0000" in text or "\\ud" in text or ESCAPED in text:  # as jsonb_dumps tells
            text = json_dumps(escape_json(value), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return text


def _timestamp(value: Any) -> datetime | None:
    """Celery's ``date_done`` (ISO 8601 text or datetime) as an aware datetime (a naive one:
    UTC, as in a message)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    return aware(value)
