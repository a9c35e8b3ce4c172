"""Connectors: the psycopg connection under whatever ``db`` a caller hands to pgbroker.

:func:`pgbroker.enqueue`, :func:`pgbroker.enqueue_many` and :func:`pgbroker.transaction` write
in the caller's own transaction, on its own connection. A connector wraps one kind of ``db``
and gives pgbroker two things: :meth:`Connector.connection`, the psycopg 3 connection to write
on, inside the caller's transaction, and :meth:`Connector.hooks`, the commit and rollback events
of the caller's library, if it has any. There is one connector per library, side by side
(procrastinate's ``psycopg_connector.py`` and ``contrib/django/django_connector.py``):

* :class:`PsycopgConnector` (here): a psycopg 3 ``Connection``; no events.
* :class:`pgbroker._produce.connectors.sqlalchemy_session.SQLAlchemyConnector`: a ``Session``,
  ``scoped_session`` or ``Connection`` on the psycopg 3 driver; commit and rollback events.
* :class:`pgbroker._produce.connectors.django_connection.DjangoConnector`: a Django database
connection.

:func:`connector_for` picks one by the type of ``db``. The asyncio forms (:mod:`pgbroker.aio`)
take an :class:`AsyncConnector`, picked by :func:`aconnector_for`: the same two things, but
``connection()`` is awaited and gives a psycopg ``AsyncConnection``, and ``hooks`` takes a
coroutine function to flush with:

* :class:`AsyncPsycopgConnector` (here): a psycopg 3 ``AsyncConnection``; no events.
* :class:`pgbroker._produce.connectors.sqlalchemy_async.AsyncSQLAlchemyConnector`: an
  ``AsyncSession``, ``async_scoped_session`` or ``AsyncConnection`` on psycopg's async driver.

The statements are one coroutine text for both kinds (:mod:`pgbroker._produce.write` over
:mod:`pgbroker._pg.any_connection`); the messages (:mod:`pgbroker._produce.build`) and their
parameters (:mod:`pgbroker._model.job`) do no I/O and serve both. A connection of the other kind is
refused by each picker with a TypeError that names the right form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import psycopg

__all__ = ["AsyncConnector", "AsyncPsycopgConnector", "Connector", "PsycopgConnector",
           "aconnector_for", "connector_for"]

#: What a synchronous API is told to use for an asyncio connection, and the other way round.
USE_ASYNC = ("an asyncio connection: use `await pgbroker.aenqueue(...)`, "
             "`await pgbroker.aenqueue_many(...)` or `async with pgbroker.atransaction(...)`")
USE_SYNC = ("a synchronous connection: use `pgbroker.enqueue(...)`, "
            "`pgbroker.enqueue_many(...)` or `with pgbroker.transaction(...)`")


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


class AsyncConnector(Protocol):
    """What pgbroker's asyncio forms need of a caller's ``db``."""

    db: Any
    has_events: bool

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        """The psycopg ``AsyncConnection`` under ``db``, inside the caller's transaction."""

    def begin(self) -> None:
        """Begin the library's own transaction if none is open, without I/O (a publish inside
        ``atransaction`` cannot wait for any), so that its rollback event fires."""

    def hooks(self, flush: Callable[[], Awaitable[None]],
              discard: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
        """While open: ``await flush()`` before the caller commits, ``discard()`` at its
        rollback."""


class AsyncPsycopgConnector:
    """A psycopg 3 ``AsyncConnection``, used as it is (as :class:`PsycopgConnector`)."""

    has_events = False

    def __init__(self, db: psycopg.AsyncConnection[Any]):
        self.db = db

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        return self.db

    def begin(self) -> None:
        pass  # psycopg begins at the first statement, and has no rollback event

    @contextlib.contextmanager
    def hooks(self, flush: Callable[[], Awaitable[None]],
              discard: Callable[[], None]) -> Iterator[None]:
        yield  # psycopg has no commit hook


def _asynchronous(db: Any) -> bool:
    return isinstance(db, psycopg.AsyncConnection) or type(db).__module__.startswith(
        "sqlalchemy.ext.asyncio.")


def _named(db: Any) -> str:
    return f"{type(db).__module__}.{type(db).__name__}"


def connector_for(db: Any) -> Connector:
    """The connector for ``db``.

    Raises:
        TypeError: ``db`` is none of the connections pgbroker supports (an asyncio one: the
            message names pgbroker's asyncio forms).
    """
    if isinstance(db, psycopg.Connection):
        return PsycopgConnector(db)
    if _asynchronous(db):
        raise TypeError(f"pgbroker.enqueue, enqueue_many and transaction() are synchronous, "
                        f"but {_named(db)} is {USE_ASYNC}")
    module = type(db).__module__
    # Imported only for a db of theirs: Django is an optional dependency, and a psycopg-only
    # caller need not pay for importing SQLAlchemy (whose connector imports it at the top).
    if module.startswith("django."):
        from .django_connection import DjangoConnector

        return DjangoConnector(db)
    if module.startswith("sqlalchemy."):
        from .sqlalchemy_session import SQLAlchemyConnector  # lazily: see above

        if SQLAlchemyConnector.accepts(db):
            return SQLAlchemyConnector(db)
    raise TypeError("pgbroker needs a SQLAlchemy Session or Connection, a Django connection or "
                    f"a psycopg 3 Connection (synchronous), not {_named(db)}")


def aconnector_for(db: Any) -> AsyncConnector:
    """The connector for ``db``, for the asyncio forms.

    Raises:
        TypeError: ``db`` is none of the asyncio connections pgbroker supports (a synchronous
            one: the message names the synchronous forms).
    """
    if isinstance(db, psycopg.AsyncConnection):
        return AsyncPsycopgConnector(db)
    if type(db).__module__.startswith("sqlalchemy.ext.asyncio."):
        # SQLAlchemy's asyncio extension needs greenlet (the asyncio extra): imported only for
        # a db of its own.
        from .sqlalchemy_async import AsyncSQLAlchemyConnector

        if isinstance(db, AsyncSQLAlchemyConnector.kinds):
            return AsyncSQLAlchemyConnector(db)
    try:
        connector_for(db)
    except TypeError:
        pass
    else:
        raise TypeError(f"pgbroker.aenqueue, aenqueue_many and atransaction() are for asyncio, "
                        f"but {_named(db)} is {USE_SYNC}")
    raise TypeError("pgbroker's asyncio forms need a SQLAlchemy AsyncSession or AsyncConnection "
                    f"or a psycopg 3 AsyncConnection, not {_named(db)}")
