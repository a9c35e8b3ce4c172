"""A message to insert (:class:`NewJob`) and how it becomes a statement's parameters.

One encoder per wire format, and nothing else encodes a NewJob:

* :func:`row_params`: one row, psycopg adapting each value (``job_insert``, ``job_insert_dead``,
  ``job_fanout`` through psycopg's own binding);
* :func:`row_text_params`: one row as the text-format values of ``Store.insert``'s prepared
  statement (the body and the digest stay bytes: sent in binary format);
* :func:`batch_lists`: ``job_insert_many``'s columns as lists psycopg adapts (the broker's own
  batches, and a client-side-binding cursor such as Django's);
* :func:`batch_arrays`: the same columns as PostgreSQL binary arrays made here (enqueue_many).

:func:`lookup_params` and :func:`log_duplicates` are ``job_enqueued_ids``'s way in and out.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.json import Jsonb

from .keys import dedupe_key
from .text import jsonb_dumps

__all__ = ["NewJob", "message_digest", "row_params", "row_text_params", "batch_lists",
           "batch_arrays", "register_array_dumpers", "lookup_params", "log_duplicates"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NewJob:
    """A message to insert; built by the transport or by :func:`pgbroker.enqueue`."""

    id: uuid.UUID
    queue: str
    body: bytes
    content_type: str | None
    content_encoding: str | None
    headers: dict[str, Any]
    properties: dict[str, Any]
    exchange: str = ""
    routing_key: str = ""
    task: str | None = None
    task_id: str | None = None
    retries: int = 0
    priority: int = 0
    max_attempts: int = 5
    run_at: datetime | None = None
    expires_at: datetime | None = None
    idempotency_key: str | None = None
    #: ``headers`` and ``properties`` as jsonb text (escaped where needed: pgbroker._model.text),
    #: made once where the message was checked; None: made from the dicts when sent.
    headers_json: str | None = None
    properties_json: str | None = None

    def json_text(self) -> tuple[str, str]:
        """``headers`` and ``properties`` as jsonb text."""
        return (self.headers_json if self.headers_json is not None else jsonb_dumps(self.headers),
                self.properties_json if self.properties_json is not None
                else jsonb_dumps(self.properties))

    def jsonb(self) -> tuple[Jsonb, Jsonb]:
        """``headers`` and ``properties`` as psycopg parameters."""
        headers, properties = self.json_text()
        return (Jsonb(self.headers, dumps=lambda _: headers),
                Jsonb(self.properties, dumps=lambda _: properties))

    def digest(self) -> bytes:
        """:func:`message_digest` of this message."""
        headers, properties = self.json_text()
        return message_digest(self, headers.encode(), properties.encode())


def message_digest(job: NewJob, headers_json: bytes, properties_json: bytes) -> bytes:
    """SHA-256 of what the producer sent: body, content type and encoding, exchange, routing key,
    and the JSON of the headers and properties (as stored: ``json.dumps``, escaped where
    PostgreSQL cannot hold a string, see pgbroker._model.text; the properties hold
    no ``delivery_tag``, which kombu makes anew for every ``_publish``).

    With the task id and the queue it is the publish dedupe key (``jobs_message_idx``): only a
    producer's own retry of one publish (kombu's ``ensure`` running ``_publish`` again after the
    INSERT committed) sends the same message twice. Every Celery re-publish differs from the
    message it follows: ``Task.retry`` in ``retries`` and ``eta``, ``Task.replace`` in
    ``replaced_task_nesting`` and the body, canvas members given one explicit id in their
    arguments. Two identical messages sent on purpose with one explicit task id are one job
    (the README's "Guarantees and limits").
    """
    return hashlib.sha256(b"\0".join((
        b"%d" % len(job.body), job.body, (job.content_type or "").encode(),
        (job.content_encoding or "").encode(), job.exchange.encode(), job.routing_key.encode(),
        headers_json, properties_json))).digest()


# -- one row ---------------------------------------------------------------------------------------

def row_params(job: NewJob) -> dict[str, Any]:
    """``job_insert``'s parameters for ``job``, psycopg adapting each value."""
    headers, properties = job.jsonb()
    return {
        "id": job.id, "queue": job.queue, "task": job.task, "task_id": job.task_id,
        "retries": job.retries, "exchange": job.exchange, "routing_key": job.routing_key,
        "body": job.body, "content_type": job.content_type,
        "content_encoding": job.content_encoding, "headers": headers,
        "properties": properties, "priority": job.priority,
        "max_attempts": job.max_attempts, "run_at": job.run_at,
        "expires_at": job.expires_at, "idempotency_key": job.idempotency_key,
        "message_digest": job.digest(),
    }


def row_text_params(job: NewJob) -> dict[str, bytes | None]:
    """:func:`row_params` as text-format parameters (the body and the digest stay bytes: binary
    format)."""
    headers, properties = (text.encode() for text in job.json_text())
    return {
        "id": str(job.id).encode(), "queue": job.queue.encode(), "task": _text(job.task),
        "task_id": _text(job.task_id), "retries": b"%d" % job.retries,
        "exchange": job.exchange.encode(), "routing_key": job.routing_key.encode(),
        "body": job.body, "content_type": _text(job.content_type),
        "content_encoding": _text(job.content_encoding),
        "headers": headers, "properties": properties, "priority": b"%d" % job.priority,
        "max_attempts": b"%d" % job.max_attempts, "run_at": _text(job.run_at),
        "expires_at": _text(job.expires_at), "idempotency_key": _text(job.idempotency_key),
        "message_digest": message_digest(job, headers, properties),
    }


def _text(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat().encode()
    return str(value).encode()



# -- a batch (job_insert_many) -------------------------------------------------------------------

def batch_lists(jobs: Sequence[NewJob], channel: str) -> dict[str, Any]:
    """``job_insert_many``'s column arrays, as lists psycopg adapts."""
    cols: dict[str, list[Any]] = {}
    for job in jobs:
        for key, value in row_params(job).items():
            cols.setdefault(key, []).append(value)
    return {**cols, "channel": channel}


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
            assert value is not None  # made has None's element
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


def batch_arrays(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
                 jobs: list[NewJob], channel: str, json_of: dict[uuid.UUID, tuple[bytes, bytes]],
                 digests: dict[uuid.UUID, bytes]) -> dict[str, Any]:
    """``job_insert_many``'s parameters for ``jobs``: what :func:`batch_lists` gives, with
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
    ready = [pair for pair in made if pair is not None]
    if len(ready) < len(made):
        values = [job.jsonb() for job in jobs]
        params["headers"] = [headers for headers, _ in values]
        params["properties"] = [properties for _, properties in values]
        digests.update((job.id, job.digest()) for job in jobs)
    else:
        params["headers"] = _array("jsonb", [_LENGTH(len(h)) + h for h, _ in ready])
        params["properties"] = _array("jsonb", [_LENGTH(len(p)) + p for _, p in ready])
        # the jsonb values are a version byte and json.dumps' text: the digest's input
        digests.update((job.id, message_digest(job, h[1:], p[1:]))
                       for job, (h, p) in zip(jobs, ready, strict=True))
    params["message_digest"] = _array(
        "bytea", [_LENGTH(32) + digests[job.id] for job in jobs])
    return params


def register_array_dumpers(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> None:
    """Let ``cur`` (its adapters only) send :func:`batch_arrays`' arrays as they are."""
    for kind, dumper in _KINDS.values():
        cur.adapters.register_dumper(kind, dumper)


# -- job_enqueued_ids ----------------------------------------------------------------------------

def lookup_params(jobs: Sequence[NewJob],
                  digests: dict[uuid.UUID, bytes] | None = None) -> dict[str, list[Any]]:
    """Column arrays for ``job_enqueued_ids`` (``digests``: those already made, by job id)."""
    digests = digests or {}
    return {
        "id": [j.id for j in jobs], "task": [j.task for j in jobs],
        "idempotency_key": [j.idempotency_key for j in jobs], "queue": [j.queue for j in jobs],
        "task_id": [j.task_id for j in jobs],
        "message_digest": [digests.get(j.id) or j.digest() for j in jobs],
        "dedupe_key": [dedupe_key(j.headers) for j in jobs],
    }


def log_duplicates(jobs: Sequence[NewJob], found: Sequence[tuple[Any, Any]]) -> None:
    """A DEBUG line per job that ``job_enqueued_ids`` found to be a duplicate."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    for job, (job_id, matched) in zip(jobs, found, strict=True):
        if job_id == job.id:
            continue
        what = (f"the same message is job {job_id}" if matched == "message" else
                f"job {job_id} holds its dedupe key {dedupe_key(job.headers)!r}"
                if matched == "dedupe" else
                f"its idempotency key {job.idempotency_key!r} is job {job_id}" if matched else
                "the job it duplicates was deleted meanwhile")
        logger.debug("pgbroker: publish of task %r (%s) to queue %r deduplicated: %s",
                     job.task, job.task_id, job.queue, what)
