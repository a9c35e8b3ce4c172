"""pgbroker: a Celery broker whose queue is a PostgreSQL table.

``import pgbroker`` registers the ``pgbroker://`` URL scheme with kombu, so a Celery app needs
only ``broker_url = "pgbroker://user@host/db"``.
"""

from __future__ import annotations

from . import signals
from ._celery import endings as _endings
from ._celery import failures as _failures
from ._celery import inspect_scheduled as _inspect_scheduled
from ._celery import prefetch as _prefetch
from ._celery import startup as _startup
from ._celery.complete import complete
from .aio import aenqueue, aenqueue_many, atransaction
from .enqueue import enqueue, enqueue_many, transaction
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
from .migrate import migrate
from .settings import Settings
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

# what pgbroker does in Celery's processes: connected to Celery's signals once, when imported
register_scheme()
_failures.connect()
_endings.connect()
_inspect_scheduled.connect()
_startup.connect()
_prefetch.connect()
