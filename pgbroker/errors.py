"""The few exceptions pgbroker raises.

::

    PgBrokerError
     ├── ConfigurationError (ValueError)     bad transport option, URL or schema name
     ├── DatabaseUnavailable (ConnectionError) the database cannot be reached; Celery reconnects
     ├── SchemaError                          schema missing, or migrated by a newer pgbroker
     ├── MessageError (ValueError)            a message refused at publish (size, name, header)
     │    └── IdempotencyKeyRequired          a task configured to need a key was sent without one
     ├── OperationError                       an operator action that cannot be done as asked
     ├── DeliveryLost                         pgbroker.complete(): the delivery is no longer the
     │                                        task's to complete (its transaction must not commit)
     └── JobDead                              AsyncResult.get(): the task's job ended dead and no
                                              result of it is stored (the message says why)

Driver errors are translated in :mod:`pgbroker._pg.driver` with ``__cause__`` kept.
"""

from __future__ import annotations

__all__ = [
    "PgBrokerError",
    "ConfigurationError",
    "DatabaseUnavailable",
    "SchemaError",
    "MessageError",
    "IdempotencyKeyRequired",
    "OperationError",
    "DeliveryLost",
    "JobDead",
]


class PgBrokerError(Exception):
    """Base class of every pgbroker error."""


class ConfigurationError(PgBrokerError, ValueError):
    """A transport option, URL or schema name is invalid."""


class DatabaseUnavailable(PgBrokerError, ConnectionError):
    """The database cannot be reached or the connection was lost."""


class SchemaError(PgBrokerError):
    """The pgbroker schema is missing or at a version this code does not know."""


class MessageError(PgBrokerError, ValueError):
    """A message cannot be accepted for publishing."""


class IdempotencyKeyRequired(MessageError):
    """The task is configured to require an idempotency key and none was given."""


class OperationError(PgBrokerError):
    """An operator action that cannot be done as asked; the message says why. Nothing changed."""


class DeliveryLost(PgBrokerError):
    """:func:`pgbroker.complete` cannot complete the current delivery (it was taken back, acked
    on receipt or completed already): the task's transaction must not commit."""


class JobDead(PgBrokerError):
    """The task's job ended ``dead`` and no result of it is stored: its success could not be
    written (a disk full, a lock or statement timeout), or its worker was lost during every
    attempt. The message is the job's ``last_error``. What the pgbroker result backend reports
    as the task's FAILURE, rather than PENDING for ever."""
