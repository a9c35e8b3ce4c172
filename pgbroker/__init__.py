"""pgbroker: a Celery broker whose queue is a PostgreSQL table.

``import pgbroker`` registers the ``pgbroker://`` URL scheme with kombu, so a Celery app needs
only ``broker_url = "pgbroker://user@host/db"``.
"""

from __future__ import annotations

from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DeliveryLost,
    IdempotencyKeyRequired,
    JobDead,
    MessageError,
    OperationError,
    PgBrokerError,
    SchemaError,
)
from .aio import aenqueue, aenqueue_many, atransaction
from .enqueue import enqueue, enqueue_many, transaction
from ._complete import complete
from .migrate import migrate
from .settings import Settings
from . import _endings, _failures, _prefetch, _scheduled, _startup, signals  # signals: public
from .transport import register_scheme

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailable",
    "DeliveryLost",
    "IdempotencyKeyRequired",
    "JobDead",
    "MessageError",
    "OperationError",
    "PgBrokerError",
    "SchemaError",
    "Settings",
    "aenqueue",
    "aenqueue_many",
    "atransaction",
    "complete",
    "enqueue",
    "enqueue_many",
    "migrate",
    "signals",
    "transaction",
]

__version__ = "0.1.0"

register_scheme()
_failures.connect()
_endings.connect()
_scheduled.connect()
_startup.connect()
_prefetch.connect()
