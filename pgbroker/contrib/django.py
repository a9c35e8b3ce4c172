"""Django: enqueue jobs in the transaction of Django's own database connection.

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
pgbroker, never a runtime one: this module imports it only when called.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg

__all__ = ["connection", "driver_connection", "enqueue", "enqueue_many", "transaction"]


def driver_connection(db: Any) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under a Django connection (``django.db.connection`` or
    ``django.db.connections[alias]``).

    Opens the Django connection if it is not open yet (as Django's own first query would).

    Raises:
        TypeError: ``db`` is not a Django connection, or not PostgreSQL on psycopg 3.
    """
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(db, ConnectionProxy):  # django.db.connection: this thread's "default"
        db = connections[db.alias]
    if not isinstance(db, BaseDatabaseWrapper):
        raise TypeError(f"expected a Django database connection (django.db.connections[...]), "
                        f"not {type(db).__module__}.{type(db).__name__}")
    if db.vendor != "postgresql":
        raise TypeError(f"pgbroker needs PostgreSQL, but Django database {db.alias!r} is "
                        f"{db.vendor} ({db.settings_dict.get('ENGINE')})")
    db.ensure_connection()
    raw = db.connection
    if not isinstance(raw, psycopg.Connection):
        raise TypeError(
            f"pgbroker needs the psycopg 3 driver, but Django database {db.alias!r} runs on "
            f"{type(raw).__module__}: install psycopg 3 (`pip install psycopg`), which Django "
            "4.2 and later prefer to psycopg2")
    return raw


def connection(using: str | None = None) -> psycopg.Connection[Any]:
    """The psycopg 3 connection of Django database ``using`` (default: ``"default"``), in the
    transaction Django has open in this thread."""
    from django.db import DEFAULT_DB_ALIAS, connections

    return driver_connection(connections[using or DEFAULT_DB_ALIAS])


def enqueue(task: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
            using: str | None = None, **options: Any) -> uuid.UUID:
    """:func:`pgbroker.enqueue` on Django database ``using``; returns the job's id."""
    from ..enqueue import enqueue as _enqueue

    return _enqueue(connection(using), task, args, kwargs, **options)


def enqueue_many(jobs: Iterable[Sequence[Any]], *, using: str | None = None,
                 **options: Any) -> list[uuid.UUID]:
    """:func:`pgbroker.enqueue_many` on Django database ``using``."""
    from ..enqueue import enqueue_many as _enqueue_many

    return _enqueue_many(connection(using), jobs, **options)


@contextlib.contextmanager
def transaction(using: str | None = None) -> Iterator[None]:
    """:func:`pgbroker.transaction` on Django database ``using``: ``.delay()`` and
    ``.apply_async()`` inside the block are written in Django's transaction.

    Open it inside ``transaction.atomic()`` and leave it before the atomic block ends (the jobs
    are written when this block is left).
    """
    from ..enqueue import transaction as _transaction

    with _transaction(connection(using)):
        yield
