"""Django: pgbroker's Django app, and jobs enqueued in the transaction of Django's connection.

``"pgbroker.contrib.django"`` in ``INSTALLED_APPS`` (:mod:`.apps`) gives the schema by
``manage.py migrate``, ``manage.py pgbroker ...``, system checks, and with
``PGBROKER_JOIN_ATOMIC = True`` a plain ``.delay()`` inside ``atomic()`` written in Django's
transaction (docs/django.md). This module is the explicit API, app or not.

Inside ``transaction.atomic()``, a job written through Django's connection exists exactly when
Django commits, and vanishes with a rollback::

    from django.db import transaction
    from pgbroker.contrib import django as pgdjango

    with transaction.atomic():
        order = Order.objects.create(...)
        pgdjango.enqueue(send_confirmation, (order.pk,))    # pgbroker.enqueue on Django's db
        with pgdjango.transaction():                        # or: route .delay() through it
            notify_shop.delay(order.pk)

This works because Django (4.2 and later, with psycopg 3 installed) runs on a psycopg 3
connection, ``connection.connection``: :func:`connection` returns it, and pgbroker writes on it
in whatever transaction Django has open. Limits: psycopg 2 (``psycopg2``) and other databases
are refused with a clear error; outside ``atomic()`` Django is in autocommit mode, so each job is
committed at once, as any other Django query would be. Django stays a test dependency of
pgbroker, never a runtime one: this module imports it only when called. The connector under
these functions is :mod:`pgbroker._pg.django_db`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg

from ..._pg.django_db import driver_connection
from ...enqueue import enqueue as _enqueue
from ...enqueue import enqueue_many as _enqueue_many
from ...enqueue import transaction as _transaction

__all__ = ["connection", "driver_connection", "enqueue", "enqueue_many", "transaction"]


def connection(using: str | None = None) -> psycopg.Connection[Any]:
    """The psycopg 3 connection of Django database ``using`` (default: ``"default"``), in the
    transaction Django has open in this thread."""
    from django.db import DEFAULT_DB_ALIAS, connections  # optional: see the module docstring

    return driver_connection(connections[using or DEFAULT_DB_ALIAS])


def enqueue(task: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
            using: str | None = None, **options: Any) -> uuid.UUID:
    """:func:`pgbroker.enqueue` on Django database ``using``; returns the job's id."""
    return _enqueue(connection(using), task, args, kwargs, **options)


def enqueue_many(jobs: Iterable[Sequence[Any]], *, using: str | None = None,
                 **options: Any) -> list[uuid.UUID]:
    """:func:`pgbroker.enqueue_many` on Django database ``using``."""
    return _enqueue_many(connection(using), jobs, **options)


@contextlib.contextmanager
def transaction(using: str | None = None) -> Iterator[None]:
    """:func:`pgbroker.transaction` on Django database ``using``: ``.delay()`` and
    ``.apply_async()`` inside the block are written in Django's transaction.

    Open it inside ``transaction.atomic()`` and leave it before the atomic block ends (the jobs
    are written when this block is left).
    """
    with _transaction(connection(using)):
        yield
