"""Transport options of other brokers that a Celery user brings to pgbroker.

A configuration moved from Redis, SQS, RabbitMQ or kombu's SQLAlchemy/PGMQ transports keeps its
``broker_transport_options``. Each option known here is either mapped onto the pgbroker option
with the same meaning (:data:`MAPPED`, e.g. ``polling_interval`` -> ``poll_interval``) or
accepted with one WARNING per process and option that says what pgbroker does instead
(:data:`INSTEAD`), so nothing is ignored without a word. Options kombu or Celery themselves read
for any transport (:data:`KOMBU_OPTIONS`) are accepted quietly: they work here as anywhere. Any
other name stays an error (:mod:`pgbroker.settings`).
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError

__all__ = ["INSTEAD", "KOMBU_OPTIONS", "MAPPED", "translate"]

logger = logging.getLogger("pgbroker.settings")

#: Options that kombu or Celery themselves read from transport_options, for every transport:
#: kombu's connection retry policy (``Connection.ensure_connection``) and the virtual channel's.
KOMBU_OPTIONS = frozenset({
    "body_encoding", "deadletter_queue", "max_retries", "interval_start", "interval_step",
    "interval_max", "connect_retries_timeout",
})

#: Another transport's option -> the pgbroker option that means the same.
MAPPED = {
    # Redis (BRPOP timeout), SQS and kombu's SQLAlchemy (sleep between empty polls): how long an
    # idle consumer waits before it looks again; pgbroker's wait is on LISTEN, this its fallback
    "polling_interval": "poll_interval",
    # Redis: seconds to wait for a connection
    "socket_connect_timeout": "connect_timeout",
}

_LEASE = ("pgbroker has no visibility timeout: a running job is redelivered only when its "
          "worker's lease (lease_timeout) expires, never while the worker lives")
_UNACKED = ("unacked messages are rows in state 'running'; those of a lost worker go back to "
            "pending when its lease (lease_timeout) expires")
_NAMES = ("every queue lives in the tables of one schema: set the 'schema' option to keep "
          "applications apart")
_FANOUT = ("fanout bindings are rows in the database that every worker reads: there is "
           "nothing to prefix or match")
_PRIORITY = ("a priority is a column (0-255, higher first, AMQP's direction) and orders every "
             "claim exactly: there are no steps")
_SOCKET = ("connections are libpq's: give keepalives and timeouts in the URL "
           "(pgbroker+postgresql://...?keepalives_idle=30); heartbeats find a lost worker")
_WAIT = ("workers wait on LISTEN/NOTIFY and claim at once; poll_interval is only the fallback "
         "for a lost notification")
_CLOUD = "the database URL says where messages are: there is no region, endpoint or account"

#: Another transport's option -> what pgbroker does instead (the WARNING's text).
INSTEAD = {
    "visibility_timeout": _LEASE,
    # Redis's emulation of acks
    "ack_emulation": _UNACKED, "unacked_key": _UNACKED, "unacked_index_key": _UNACKED,
    "unacked_mutex_key": _UNACKED, "unacked_mutex_expire": _UNACKED,
    "unacked_restore_limit": _UNACKED, "unacked_restore_interval": _UNACKED,
    "unacked_restore_throttle": _UNACKED,
    # names of keys, queues and tables
    "global_keyprefix": _NAMES, "queue_name_prefix": _NAMES, "queue_tablename": _NAMES,
    "message_tablename": _NAMES,
    "fanout_prefix": _FANOUT, "fanout_patterns": _FANOUT, "sentinel_fanout_compat": _FANOUT,
    "queue_order_strategy": _PRIORITY, "priority_steps": _PRIORITY, "sep": _PRIORITY,
    # Redis and RabbitMQ connections
    "socket_timeout": _SOCKET, "socket_keepalive": _SOCKET, "socket_keepalive_options": _SOCKET,
    "retry_on_timeout": _SOCKET, "health_check_interval": _SOCKET, "max_connections": _SOCKET,
    "client_name": _SOCKET, "client_properties": _SOCKET, "master_name": _SOCKET,
    "min_other_sentinels": _SOCKET, "sentinel_kwargs": _SOCKET,
    "wait_time_seconds": _WAIT, "max_poll_seconds": _WAIT, "use_notify": _WAIT,
    # SQS
    "region": _CLOUD, "regioninfo": _CLOUD, "is_secure": _CLOUD, "port": _CLOUD,
    "predefined_queues": _CLOUD, "sts_role_arn": _CLOUD, "sts_token_timeout": _CLOUD,
    "queue_tags": _CLOUD, "sqs-creation-attributes": _CLOUD, "client-config": _CLOUD,
    "backoff_policy": ("a retried task waits in the database until its countdown "
                       "(Celery's retry_backoff, or pgbroker.backoff): there is no SQS policy"),
    "backoff_tasks": "see backoff_policy: retry delays are Celery's own",
    "fetch_message_attributes": "every message keeps all its headers and properties",
    "sqs_base64_encoding": "bodies are stored as bytes: no encoding is needed",
    "fifo_mode": ("a queue is claimed in priority order, then oldest first; use a concurrency "
                  "key for one at a time"),
    # RabbitMQ
    "confirm_publish": ("every publish is confirmed: it returns once its INSERT has committed "
                        "(durable_publish: after the WAL flush)"),
}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def translate(options: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    """``options`` as pgbroker options: mapped names renamed, foreign ones warned about once
    and dropped, kombu's dropped; names in ``known`` kept.

    Raises:
        ConfigurationError: an option is neither known nor foreign (the closest known name is
            suggested), or a mapped option and its pgbroker name are both given, with other
            values.
    """
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key in known:
            values[key] = value
        elif key in MAPPED:
            _warn_once(key, f"transport option {key!r} is read as pgbroker's "
                       f"{MAPPED[key]!r}", logging.INFO)
        elif key in INSTEAD:
            _warn_once(key, f"transport option {key!r} does nothing here: {INSTEAD[key]}",
                       logging.WARNING)
        elif key not in KOMBU_OPTIONS:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(f"unknown pgbroker transport option {key!r}{hint}")
    for key, own in MAPPED.items():
        if key not in options:
            continue
        if own in values and values[own] != options[key]:
            raise ConfigurationError(f"transport options {key!r} ({options[key]!r}) and {own!r} "
                                     f"({values[own]!r}) mean the same: give {own!r} only")
        values[own] = options[key]
    return values


def _warn_once(key: str, message: str, level: int) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.log(level, message)
