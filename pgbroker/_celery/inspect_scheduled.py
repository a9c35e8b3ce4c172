"""``celery inspect scheduled`` answered from the database.

Celery's own ``scheduled`` command lists the eta tasks waiting in the worker's timer. Over
pgbroker a countdown/eta task waits in the database (state ``scheduled``) until it is due, so
that list is empty. :func:`install` puts :func:`scheduled` in Celery's control Panel in its place
(same name, same alias ``dump_schedule``): a worker whose broker is pgbroker answers with what
Celery's command finds in its timer, followed by the earliest scheduled jobs of the queues it
consumes, in Celery's reply format; with any other broker it is Celery's command unchanged.

Limits: every worker consuming a queue lists that queue's scheduled jobs (a job has no worker
until it is due), so two workers of one queue list the same jobs. At most ``limit`` entries per
worker (:data:`DEFAULT_LIMIT`, at most :data:`MAX_LIMIT`): a reply is one message through a
reply row, and a queue can hold 100,000 scheduled jobs. ``pgbroker jobs list --state scheduled``
lists them all. ``priority`` is the timer entry's, as Celery's worker reports it
(:data:`TIMER_PRIORITY`); the message's own priority is in ``request.delivery_info``, as there.
"""

from __future__ import annotations

import sys
from datetime import timezone
from typing import Any

from celery import signals
from kombu.serialization import loads

from ..transport import Transport

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "TIMER_PRIORITY", "install", "connect", "scheduled"]

#: Entries a worker lists when the caller gives no limit (``celery inspect scheduled [limit]``).
DEFAULT_LIMIT = 100
#: The most a caller may ask for.
MAX_LIMIT = 1000
#: Bodies longer than this are not read: their ``argsrepr``/``kwargsrepr`` headers stand in, so a
#: reply of MAX_LIMIT entries stays a few MB (the transport's max_message_size is 16 MiB).
BODY_MAX = 4096
#: The priority Celery's worker gives an eta request in its timer (celery/worker/strategy.py,
#: ``call_at(eta, ..., priority=6)``) and ``inspect scheduled`` reports.
TIMER_PRIORITY = 6

_JSON = "application/json"

#: Celery's own command, called first (set by :func:`install`).
_celery_scheduled: Any = None


def scheduled(state: Any, limit: Any = None, **kwargs: Any) -> list[dict[str, Any]]:
    """List of currently scheduled ETA/countdown tasks (pgbroker: and those in the database)."""
    own = _celery_scheduled(state, **kwargs) if _celery_scheduled is not None else []
    consumer = state.consumer
    connection = getattr(consumer, "connection", None)
    task_consumer = getattr(consumer, "task_consumer", None)
    transport = connection.transport if connection is not None else None
    if not isinstance(transport, Transport) or task_consumer is None:
        return own
    try:
        limit = max(1, min(int(limit), MAX_LIMIT)) if limit is not None else DEFAULT_LIMIT
    except (TypeError, ValueError):
        limit = DEFAULT_LIMIT
    queues = sorted({queue.name for queue in task_consumer.queues})
    if not queues or len(own) >= limit:
        return own[:limit]
    seen = {entry["request"]["id"] for entry in own}
    rows = transport.store.scheduled(queues, limit - len(own), BODY_MAX)
    return own + [_entry(row, state.hostname) for row in rows if row[0] not in seen]


def _entry(row: tuple[Any, ...], hostname: str) -> dict[str, Any]:
    """One job row as Celery's ``scheduled`` lists a timer entry (``Request.info()`` inside)."""
    (task_id, task, run_at, priority, exchange, routing_key, attempts, content_type,
     content_encoding, body, argsrepr, kwargsrepr) = row
    args, kwargs = _arguments(body, content_type, content_encoding)
    if args is None:
        args, kwargs = argsrepr, kwargsrepr  # Request.info(safe=True) gives these, too
    return {
        "eta": run_at.astimezone(timezone.utc).isoformat(),  # UTC, as Celery sends it
        "priority": TIMER_PRIORITY,
        "request": {
            "id": task_id,
            "name": task,
            "args": args,
            "kwargs": kwargs,
            "type": task,
            "hostname": hostname,
            "time_start": None,
            "acknowledged": False,
            "delivery_info": {"exchange": exchange, "routing_key": routing_key,
                              "priority": priority, "redelivered": attempts > 0},
            "worker_pid": None,
        },
    }


def _arguments(body: Any, content_type: str | None,
               content_encoding: str | None) -> tuple[Any, Any]:
    """(args, kwargs) of a JSON task message (protocol 2 or 1); (None, None) for a body too
    long to read here, another serializer (never unpickled here) or anything unexpected."""
    if body is None or content_type != _JSON:
        return None, None
    try:
        decoded = loads(bytes(body), content_type, content_encoding, accept=[_JSON])
    except Exception:  # noqa: BLE001 - the worker reports the bad message when it is due
        return None, None
    if isinstance(decoded, list) and len(decoded) == 3:  # protocol 2: (args, kwargs, embed)
        return decoded[0], decoded[1]
    if isinstance(decoded, dict):  # protocol 1
        return decoded.get("args"), decoded.get("kwargs")
    return None, None


def install(**_: Any) -> None:
    """Register :func:`scheduled` in Celery's control Panel in place of Celery's (idempotent)."""
    global _celery_scheduled
    # here, not at the top: a producer need not import the worker's modules (see connect)
    from celery.worker import control

    current = control.Panel.data.get("scheduled")
    if current is scheduled:
        return
    _celery_scheduled = current
    control.inspect_command(alias="dump_schedule", args=[("limit", int)],
                            signature="[limit]")(scheduled)


def connect() -> None:
    """Install now if Celery's control module is loaded (the ``celery`` command loads it before
    the app), else when a worker starts: a producer need not import the worker's modules."""
    if "celery.worker.control" in sys.modules:
        install()
    signals.worker_init.connect(install, weak=False, dispatch_uid="pgbroker.scheduled")
