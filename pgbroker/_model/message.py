"""kombu messages <-> job rows: every check made at publish, and the payload handed to kombu.

Shared by the transport's publisher (``Channel._put`` -> :mod:`pgbroker._produce.publish`) and by
:func:`pgbroker.enqueue`'s message builder (:mod:`pgbroker._produce.build`), so a message written
through either path is the same row and is validated the same way; the consumer's side
(:mod:`pgbroker._consume.delivery`) builds a claimed row's payload with :func:`kombu_payload`.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import uuid6

from ..errors import IdempotencyKeyRequired, MessageError
from ..settings import Settings
from .job import NewJob
from .keys import check_headers
from .text import JsonError, checked_name, jsonb_dumps

__all__ = ["MAX_NAME_LENGTH", "MAX_NAME_BYTES", "MAX_BINDING_BYTES", "MAX_ID_BYTES",
           "TRANSIENT", "REQUEUED", "validate_queue_name", "validate_binding",
           "delivery_tag", "parse_delivery_tag", "message_to_job", "kombu_payload", "due_now",
           "aware"]

#: Longest queue, exchange or routing key name accepted (Celery's reply queues are ~55 characters).
MAX_NAME_LENGTH = 1000

# PostgreSQL's btree entries hold at most 2704 bytes (8 KiB pages), counted after compression,
# so an incompressible value fails long before a repetitive one: the limits below are in bytes
# of UTF-8 and keep every index entry under it uncompressed, each with its neighbours in the key.

#: Longest name in bytes: queues head jobs_claim_idx and, with task ids, jobs_task_delivery_idx.
MAX_NAME_BYTES = 1024
#: A binding's exchange, routing key and queue together (bindings' primary key).
MAX_BINDING_BYTES = 2600
#: Longest task name, task id or idempotency key in bytes (jobs_idempotency_key_idx holds a
#: task name and a key, jobs_task_delivery_idx a task id and a queue name).
MAX_ID_BYTES = 1024

_DROPPED_PROPERTIES = ("delivery_info", "delivery_tag")

TRANSIENT = 1  # AMQP delivery_mode of messages that need not survive (replies, events)

#: Why a delivery came back through reject(requeue=True): Celery gives no reason, and this is
#: what it means in a worker.
REQUEUED = ("requeued by the worker: its pool process was lost (killed or out of memory, with "
            "task_reject_on_worker_lost), or the task raised Reject(requeue=True)")


def validate_queue_name(name: Any, what: str = "queue") -> str:
    """Refuse names PostgreSQL cannot store or that are absurd; every other string is data."""
    if not isinstance(name, str) or not name:
        raise MessageError(f"{what} name must be a non-empty string, not {name!r}")
    if "\x00" in name:
        raise MessageError(f"{what} name {name!r} contains a NUL byte")
    if len(name) > MAX_NAME_LENGTH:
        raise MessageError(f"{what} name is {len(name)} characters long; the limit is "
                           f"{MAX_NAME_LENGTH}")
    checked_name(name, f"{what} name", MAX_NAME_BYTES)
    return name


def validate_binding(exchange: str, routing_key: str, queue: str) -> None:
    """Refuse a binding whose three names do not fit in one index entry together."""
    size = sum(len(name.encode()) for name in (exchange, routing_key, queue))
    if size > MAX_BINDING_BYTES:
        raise MessageError(f"the binding's exchange, routing key and queue names are {size} "
                           f"bytes in UTF-8 together; the limit is {MAX_BINDING_BYTES} bytes")


def _identity(value: Any, what: str) -> str | None:
    """A task name, task id or idempotency key as stored (None stays None)."""
    return None if value is None else checked_name(str(value), what, MAX_ID_BYTES)


def _content_label(value: Any, what: str) -> str | None:
    """content_type / content_encoding: short text, never cut at a NUL."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise MessageError(f"{what} must be a string, not {type(value).__name__}")
    return checked_name(value, what, MAX_NAME_BYTES)


def _json_text(value: dict[str, Any], what: str) -> str:
    """The jsonb text of a message's headers or properties (see pgbroker._model.text)."""
    try:
        return jsonb_dumps(value)
    except JsonError as exc:
        raise MessageError(f"message {what} cannot be stored: {exc}") from None


def _retries(headers: dict[str, Any]) -> int:
    retries = headers.get("retries")
    if retries is None:
        return 0
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise MessageError(f"the retries header must be a count (an integer >= 0), not "
                           f"{retries!r}")
    return retries


def delivery_tag(job_id: uuid.UUID, attempt: int, transient: bool = False) -> str:
    """The delivery tag of a job's attempt (see :func:`parse_delivery_tag`)."""
    return f"{job_id}/{attempt}/t" if transient else f"{job_id}/{attempt}"


def parse_delivery_tag(tag: str) -> tuple[uuid.UUID, int, bool] | None:
    """``"<job id>/<attempt>[/t]"`` -> (job id, attempt, transient); None for a broadcast
    delivery (``"b/..."``), which has no row to acknowledge."""
    parts = str(tag).split("/")
    if parts[0] == "b":
        return None
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "t"):
        raise ValueError(f"{tag!r} is not a pgbroker delivery tag (<job id>/<attempt>)")
    return uuid.UUID(parts[0]), int(parts[1]), len(parts) == 3


def aware(value: datetime) -> datetime:
    """The one rule for a naive time in a message or a result: UTC, as Celery reads one with
    its default ``enable_utc``."""
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _timestamp(value: Any, what: str) -> datetime | None:
    """A Celery ``eta``/``expires`` header (ISO 8601 text or datetime) as an aware datetime."""
    if value is None or value == 0:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, timezone.utc)  # kombu pidbox: epoch seconds
        except (OverflowError, OSError, ValueError):
            raise MessageError(f"the {what} header {value!r} is not a valid time") from None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise MessageError(f"the {what} header {value!r} is not an ISO 8601 time") from None
    if not isinstance(value, datetime):
        raise MessageError(f"the {what} header must be an ISO 8601 time, not {value!r}")
    return aware(value)


def message_to_job(settings: Settings, queue: str | None, message: dict[str, Any]) -> NewJob:
    """The row for a kombu message (as ``basic_publish`` prepared it) bound for ``queue``
    (None: a broadcast, which has no queue). Every check of a message at publish is here."""
    if queue is not None:
        validate_queue_name(queue)
    body = message.get("body")
    if isinstance(body, str):
        body = body.encode("utf-8")
    elif body is None:
        body = b""
    elif not isinstance(body, (bytes, bytearray, memoryview)):
        raise MessageError(f"message body must be bytes or str, not {type(body).__name__}")
    if len(body) > settings.max_message_size:
        raise MessageError(
            f"message body is {len(body)} bytes; the limit (max_message_size) is "
            f"{settings.max_message_size}")
    headers = message.get("headers") or {}
    if not isinstance(headers, dict):
        raise MessageError(f"message headers must be a dict, not {type(headers).__name__}")
    properties = dict(message.get("properties") or {})
    info = properties.get("delivery_info") or {}
    for what in ("exchange", "routing_key"):
        if info.get(what):
            validate_queue_name(info[what], what.replace("_", " "))
    for name in _DROPPED_PROPERTIES:
        properties.pop(name, None)
    task = headers.get("task")
    check_headers(headers)  # dedupe and concurrency keys
    retries = _retries(headers)
    key = _identity(headers.get("idempotency_key"), "idempotency key")
    # Required of every message of the task, retries too: Celery copies custom headers into a
    # retry, so a retry without the key was not sent by Celery's retry().
    if key is None and task in settings.require_idempotency_key:
        raise IdempotencyKeyRequired(
            f"task {task!r} requires an idempotency key: pass "
            "headers={'idempotency_key': ...} or use pgbroker.enqueue(..., idempotency_key=)")
    if retries:
        # A retry continues its job; it is no new enqueue, so its key must not make the
        # unique index swallow it.
        key = None
    expires_at = _timestamp(headers.get("expires"), "expires")
    expiration = properties.get("expiration")
    if expiration is not None:  # AMQP per-message TTL, in milliseconds
        try:
            ttl_at = datetime.now(timezone.utc) + timedelta(milliseconds=float(expiration))
        except (TypeError, ValueError):
            raise MessageError(f"expiration {expiration!r} is not milliseconds") from None
        expires_at = min(expires_at, ttl_at) if expires_at else ttl_at
    max_attempts = headers.get("max_attempts", settings.max_attempts)
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise MessageError(f"max_attempts header must be a positive integer, "
                           f"not {max_attempts!r}")
    headers_json = _json_text(headers, "headers")
    properties_json = _json_text(properties, "properties")
    size = len(headers_json) + len(properties_json)  # ASCII: json.dumps escapes the rest
    if size > settings.max_header_size:
        raise MessageError(f"message headers and properties are {size} bytes of JSON; the limit "
                           f"(max_header_size) is {settings.max_header_size}")
    return NewJob(
        id=uuid6.uuid7(),
        queue=queue or "",
        body=bytes(body),
        content_type=_content_label(message.get("content-type"), "content type"),
        content_encoding=_content_label(message.get("content-encoding"), "content encoding"),
        headers=headers,
        properties=properties,
        exchange=info.get("exchange") or "",
        routing_key=info.get("routing_key") or "",
        task=_identity(task, "task name") if isinstance(task, str) else None,
        task_id=_identity(headers.get("id"), "task id"),
        retries=retries,
        priority=_priority(message),
        max_attempts=max_attempts,
        run_at=_timestamp(headers.get("eta"), "eta"),
        expires_at=expires_at,
        idempotency_key=key,
        headers_json=headers_json,
        properties_json=properties_json,
    )


def _priority(message: dict[str, Any]) -> int:
    """AMQP priority 0-255 (higher runs first); anything else is the default, 0."""
    try:
        return max(0, min(int(message["properties"]["priority"]), 255))
    except (TypeError, ValueError, KeyError):
        return 0


def due_now(headers: dict[str, Any]) -> dict[str, Any]:
    """The headers of a job the database found due, for the worker about to receive it.

    Celery puts a task with an ``eta`` in a timer on the worker's own clock
    (celery/worker/strategy.py). The task sees the producer's ``eta`` exactly when this clock
    agrees that it has passed; on a clock that is behind the database's, the ``eta`` becomes
    this clock's now, so the job starts at once instead of waiting in the worker's memory for
    the clock to catch up (``self.request.eta`` is then up to the skew earlier than sent).
    """
    eta = headers.get("eta")
    if not isinstance(eta, str):
        return headers
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return headers  # not Celery's: left to the consumer, as it was sent
    now = datetime.now(timezone.utc)
    if (when if when.tzinfo else when.replace(tzinfo=timezone.utc)) <= now:
        return headers
    return {**headers, "eta": now.isoformat()}


def kombu_payload(body: bytes, content_type: str | None, content_encoding: str | None,
                  headers: dict[str, Any], properties: dict[str, Any], exchange: str,
                  routing_key: str, priority: int, tag: str, redelivered: bool) -> dict[str, Any]:
    """The message as kombu's virtual channels hand it to consumers: the headers exactly as
    the producer sent them. The delivery's identity ("<job id>/<attempt>") is the delivery tag,
    in the properties, which Celery hands to the task too (``task.request.properties``: the
    failure hook, pgbroker._celery.failures, reads it there)."""
    properties = {**properties, "delivery_tag": tag, "priority": priority, "delivery_info": {
        "exchange": exchange, "routing_key": routing_key, "priority": priority,
        "redelivered": redelivered,
    }}
    return {
        "body": bytes(body),
        "content-type": content_type,
        "content-encoding": content_encoding,
        "headers": headers,
        "properties": properties,
    }
