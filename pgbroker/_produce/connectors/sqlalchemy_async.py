"""The SQLAlchemy asyncio connector: pgbroker writes in an ``AsyncSession``'s or
``AsyncConnection``'s transaction (:mod:`pgbroker.aio`).

The engine is ``create_async_engine("postgresql+psycopg://...")``: psycopg 3's async driver,
whose ``AsyncConnection`` pgbroker writes on, in the transaction SQLAlchemy has open (or begins,
as its autobegin would). SQLAlchemy runs an async session's commit as the synchronous
``sync_session``'s, in a greenlet, so its events are the synchronous connector's
(:func:`pgbroker._produce.connectors.sqlalchemy_session.listening`); a flush inside such an event is
awaited there through ``AdaptedConnection.run_async``, SQLAlchemy's own way to await in an
event. SQLAlchemy's asyncio extension needs the ``greenlet`` package (``pgbroker[asyncio]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, cast

import psycopg
from sqlalchemy.engine import AdaptedConnection, Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.ext.asyncio.exc import AsyncContextNotStarted
from sqlalchemy.orm import Session

from .sqlalchemy_session import driver_of, listening

__all__ = ["AsyncSQLAlchemyConnector"]


class AsyncSQLAlchemyConnector:
    """A SQLAlchemy ``AsyncSession``, ``async_scoped_session`` or ``AsyncConnection`` (psycopg 3
    async driver)."""

    has_events = True
    #: the kinds of ``db`` it takes
    kinds = (async_scoped_session, AsyncSession, AsyncConnection)

    def __init__(self, db: AsyncSession | async_scoped_session[Any] | AsyncConnection):
        self.db = db

    def _own(self) -> AsyncSession | AsyncConnection:
        return self.db() if isinstance(self.db, async_scoped_session) else self.db

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        db: Any = self._own()
        if isinstance(db, AsyncSession):
            db = await db.connection()  # begins the session's transaction if none is open
        if not db.in_transaction():
            await db.begin()  # what SQLAlchemy's autobegin does: the caller's commit ends it
        raw = await db.get_raw_connection()
        driver: psycopg.AsyncConnection[Any] = driver_of(db, raw.driver_connection,
                                                         psycopg.AsyncConnection)
        return driver

    def begin(self) -> None:
        """Begin the session's (connection's) transaction if none is open. No I/O: SQLAlchemy
        connects at the first statement (the psycopg driver's BEGIN is implicit)."""
        sync = self._sync()
        if not sync.in_transaction():
            sync.begin()

    def hooks(self, flush: Callable[[], Awaitable[None]],
              discard: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
        """Flush (awaited in SQLAlchemy's greenlet) before a commit, discard at a rollback."""
        def on_flush(target: Session | Connection, *_: Any) -> None:
            conn = target.connection() if isinstance(target, Session) else target
            # the DBAPI connection of an async driver is SQLAlchemy's adapter of it
            adapted = cast(AdaptedConnection, conn.connection.dbapi_connection)
            adapted.run_async(lambda _driver: flush())

        return listening(self._sync(), on_flush, lambda *_: discard())

    def _sync(self) -> Session | Connection:
        """The synchronous Session or Connection under ours: its events are ours."""
        db = self._own()
        if isinstance(db, AsyncSession):
            return db.sync_session
        if db.sync_connection is None:  # SQLAlchemy's own error for it, not an AttributeError
            raise AsyncContextNotStarted("AsyncConnection context has not been started and object "
                                         "has not been awaited.")
        return db.sync_connection
