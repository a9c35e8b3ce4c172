"""Writing built jobs on a caller's connection: the statements of enqueue and transaction().

:func:`insert` is one job (``job_insert``), :func:`write` a batch (``job_insert_many``, one
statement per :data:`BATCH_SIZE` jobs, pipelined inside a transaction), :func:`insert_dead` a
dead letter. A duplicate (of an idempotency key, or a re-run of the same message) is resolved to
the existing job's id by ``job_enqueued_ids``. The parameters are :mod:`pgbroker._model.job`'; the
connection is the caller's, in its transaction (:mod:`pgbroker._produce.connectors`): nothing here
commits.

Each is written once, as a coroutine for a psycopg ``Connection`` or ``AsyncConnection``
(:func:`ainsert`, :func:`awrite`, :func:`ainsert_dead`: awaited by :mod:`pgbroker.aio`); the
plain functions run the same coroutine on a ``Connection``
(:func:`pgbroker._pg.any_connection.run_sync`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg.client_cursor import ClientCursorMixin
from psycopg.rows import tuple_row

from .._model.job import (
    NewJob,
    batch_arrays,
    batch_lists,
    log_duplicates,
    lookup_params,
    register_array_dumpers,
    row_params,
)
from .._pg import any_connection as _io
from .._pg import driver as _db
from .._pg.catalogue import Queries
from ..errors import SchemaError
from ..settings import Settings
from .build import Planned

__all__ = ["BATCH_SIZE", "ainsert", "ainsert_dead", "awrite", "insert", "insert_dead", "write"]

#: Jobs per statement in enqueue_many and in a transaction() block's flush.
BATCH_SIZE = 1000

#: A psycopg ``Connection`` or ``AsyncConnection``, in the caller's transaction.
Conn = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]


def insert(conn: psycopg.Connection[Any], settings: Settings, job: NewJob) -> uuid.UUID:
    """``job_insert`` for one job; returns its id (for a duplicate, the existing job's)."""
    return _io.run_sync(ainsert(conn, settings, job))


def insert_dead(conn: psycopg.Connection[Any], settings: Settings, job: NewJob,
                error: str) -> None:
    """A dead letter (an unroutable message: ``job_insert_dead``)."""
    _io.run_sync(ainsert_dead(conn, settings, job, error))


def write(conn: psycopg.Connection[Any], jobs: Sequence[tuple[Settings, NewJob | Planned]],
          batch_size: int, json_of: dict[uuid.UUID, tuple[bytes, bytes]] | None = None,
          ) -> list[uuid.UUID]:
    """:func:`awrite` on a ``Connection``."""
    return _io.run_sync(awrite(conn, jobs, batch_size, json_of))


async def ainsert(conn: Conn, settings: Settings, job: NewJob) -> uuid.UUID:
    """:func:`insert` on either kind of connection."""
    q = Queries(settings.schema)
    with _translate(settings):
        cur = await q.aexecute(conn, "job_insert",
                               {**row_params(job), "channel": settings.channel})
        # job_insert returns one row per NOTIFY sent: one when the row was inserted, none for a
        # duplicate (ON CONFLICT DO NOTHING), whose existing job is looked up (and counted).
        if cur.rowcount:
            return job.id
        found = await q.aall(conn, "job_enqueued_ids", lookup_params([job]))
    log_duplicates([job], found)
    return _resolve([job], found)[job.id]


async def ainsert_dead(conn: Conn, settings: Settings, job: NewJob, error: str) -> None:
    """:func:`insert_dead` on either kind of connection."""
    with _translate(settings):
        await Queries(settings.schema).aexecute(conn, "job_insert_dead",
                                                {**row_params(job), "error": error})


async def awrite(conn: Conn, jobs: Sequence[tuple[Settings, NewJob | Planned]],
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
    async with contextlib.AsyncExitStack() as stack:
        if pipelined:
            stack.enter_context(_translate(jobs[0][0]))
            await stack.enter_async_context(_io.pipeline(conn))
        for start in range(0, len(jobs), batch_size):
            by_schema: dict[str, tuple[Settings, list[NewJob]]] = {}
            for settings, entry in jobs[start:start + batch_size]:
                job = entry if isinstance(entry, NewJob) else entry[0].finish(entry, json_of)
                ids.append(job.id)
                by_schema.setdefault(settings.schema, (settings, []))[1].append(job)
            for settings, batch in by_schema.values():
                if pipelined:
                    sent.append(await _send_many(conn, settings, batch, json_of))
                else:
                    duplicates.update(await _insert_many(conn, settings, batch, json_of))
    if sent:
        with _translate(jobs[0][0]):
            for batch_sent in sent:
                duplicates.update(await _duplicates(conn, batch_sent))
    return [duplicates.get(job_id, job_id) for job_id in ids] if duplicates else ids


async def _insert_many(conn: Conn, settings: Settings, jobs: list[NewJob],
                       json_of: dict[uuid.UUID, tuple[bytes, bytes]],
                       ) -> dict[uuid.UUID, uuid.UUID]:
    """``job_insert_many`` for ``jobs``; keyed jobs are then looked up in the same round trip.

    Returns {id made for a job that was a duplicate: the existing job's id}.
    """
    with _translate(settings):
        if not any(job.idempotency_key is not None for job in jobs):
            return await _duplicates(conn, await _send_many(conn, settings, jobs, json_of))
        # The look-up is what tells an inserted job from a duplicate: pipelined, so the batch
        # still costs one round trip.
        async with _io.pipeline(conn):
            sent = await _send_many(conn, settings, jobs, json_of)
        return await _duplicates(conn, sent)


#: What _send_many sent for a batch: its settings, its jobs, the insert's cursor, the digests
#: made (by job id), and the look-up of its keyed jobs (their list and its cursor) if any.
_Sent = tuple[Settings, list[NewJob], "psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]",
              dict[uuid.UUID, bytes], "tuple[list[NewJob], Any] | None"]


async def _send_many(conn: Conn, settings: Settings, jobs: list[NewJob],
                     json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> _Sent:
    """Execute ``job_insert_many`` for ``jobs`` and, if some have idempotency keys (then in a
    pipeline), ``job_enqueued_ids`` for those."""
    q = Queries(settings.schema)
    # a cursor of its own rather than Queries.execute's: the array dumpers go on its adapters
    cur = conn.cursor(row_factory=tuple_row)
    digests: dict[uuid.UUID, bytes] = {}
    if isinstance(cur, ClientCursorMixin):
        # client-side binding (Django's default) writes literals: psycopg's own, from lists
        await _io.awaited(cur.execute(q["job_insert_many"], batch_lists(jobs, settings.channel)))
    else:
        register_array_dumpers(cur)
        await _io.awaited(cur.execute(q["job_insert_many"], batch_arrays(
            conn, jobs, settings.channel, json_of, digests)))
    keyed = [job for job in jobs if job.idempotency_key is not None]
    if not keyed:
        return settings, jobs, cur, digests, None
    lookup = await q.aexecute(conn, "job_enqueued_ids", lookup_params(keyed, digests))
    return settings, jobs, cur, digests, (keyed, lookup)


async def _duplicates(conn: Conn, sent: _Sent) -> dict[uuid.UUID, uuid.UUID]:
    """{id made for a job that was a duplicate: the existing job's id}, from the look-up of the
    keyed jobs and, for the other jobs the insert skipped, one more (counting them)."""
    settings, jobs, cur, digests, keyed_lookup = sent
    skipped = {row[0] for row in await _io.awaited(cur.fetchall()) if row[0] is not None}
    resolved: dict[uuid.UUID, uuid.UUID] = {}
    if keyed_lookup is not None:
        keyed, lookup = keyed_lookup
        found = await _io.awaited(lookup.fetchall())
        log_duplicates(keyed, found)
        resolved.update(_resolve(keyed, found))
    unkeyed = [job for job in jobs if job.id in skipped and job.idempotency_key is None]
    if unkeyed:  # a re-run of the same messages (the same task ids and contents)
        found = await Queries(settings.schema).aall(conn, "job_enqueued_ids",
                                                    lookup_params(unkeyed, digests))
        log_duplicates(unkeyed, found)
        resolved.update(_resolve(unkeyed, found))
    return {made: job_id for made, job_id in resolved.items() if made != job_id}


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
