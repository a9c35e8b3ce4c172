"""Connectors: the psycopg connection under whatever ``db`` a caller hands to pgbroker.

:func:`pgbroker.enqueue`, :func:`pgbroker.enqueue_many` and :func:`pgbroker.transaction` write
in the caller's own transaction, on its own connection. A connector wraps one kind of ``db``
and gives pgbroker two things: :meth:`Connector.connection`, the psycopg 3 connection to write
on, inside the caller's transaction, and :meth:`Connector.hooks`, the commit and rollback events
of the caller's library, if it has any. There is one connector per library, side by side
(procrastinate's ``psycopg_connector.py`` and ``contrib/django/django_connector.py``):

* :class:`PsycopgConnector` (here): a psycopg 3 ``Connection``; no events.
* :class:`pgbroker.contrib.sqlalchemy_connector.SQLAlchemyConnector`: a ``Session``,
  ``scoped_session`` or ``Connection`` on the psycopg 3 driver; commit and rollback events.
* :class:`pgbroker.contrib.django_connector.DjangoConnector`: a Django database connection.

:func:`connector_for` picks one by the type of ``db``. Another kind of connection is one more
connector and one more line there: an async one (psycopg's ``AsyncConnection``, SQLAlchemy's
``AsyncSession``) gives an ``async def connection()`` returning a psycopg ``AsyncConnection``,
for an async writer beside :mod:`pgbroker._write` (the messages, :mod:`pgbroker._build`, and
their parameters, :mod:`pgbroker._jobs`, do no I/O and serve both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import psycopg

__all__ = ["Connector", "PsycopgConnector", "connector_for"]


class Connector(Protocol):
    """What pgbroker needs of a caller's ``db``."""

    #: the caller's object, as given
    db: Any
    #: False: the library has no commit hook (``transaction()`` then checks, when the block is
    #: left, that the caller did not end its transaction inside it)
    has_events: bool

    def connection(self) -> psycopg.Connection[Any]:
        """The psycopg connection under ``db``, inside the caller's transaction (beginning it
        where the library would begin one at its first statement)."""

    def hooks(self, flush: Callable[[], None],
              discard: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
        """While open: ``flush()`` before the caller commits, ``discard()`` at its rollback."""


class PsycopgConnector:
    """A psycopg 3 ``Connection``, used as it is: pgbroker joins the transaction open on it
    (none in autocommit mode: then each statement is its own)."""

    has_events = False

    def __init__(self, db: psycopg.Connection[Any]):
        self.db = db

    def connection(self) -> psycopg.Connection[Any]:
        return self.db

    @contextlib.contextmanager
    def hooks(self, flush: Callable[[], None], discard: Callable[[], None]) -> Iterator[None]:
        yield  # psycopg has no commit hook


def connector_for(db: Any) -> Connector:
    """The connector for ``db``.

    Raises:
        TypeError: ``db`` is none of the connections pgbroker supports.
    """
    if isinstance(db, psycopg.Connection):
        return PsycopgConnector(db)
    module = type(db).__module__
    # Imported only for a db of theirs: Django is an optional dependency, and a psycopg-only
    # caller need not pay for importing SQLAlchemy (whose connector imports it at the top).
    if module.startswith("django."):
        from .contrib.django_connector import DjangoConnector

        return DjangoConnector(db)
    if module.startswith("sqlalchemy."):
        from .contrib.sqlalchemy_connector import SQLAlchemyConnector

        if SQLAlchemyConnector.accepts(db):
            return SQLAlchemyConnector(db)
    raise TypeError("pgbroker needs a SQLAlchemy Session or Connection, a Django connection or "
                    "a psycopg 3 Connection (synchronous), not "
                    f"{type(db).__module__}.{type(db).__name__}")
