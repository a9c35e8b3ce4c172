"""The SQLAlchemy connector: pgbroker writes in a ``Session``'s or ``Connection``'s transaction.

The engine must use the psycopg 3 driver (``postgresql+psycopg://``): pgbroker writes on the
DBAPI connection under SQLAlchemy's, in the transaction SQLAlchemy has open (or begins, as its
autobegin would), so the caller's ``commit()`` or ``rollback()`` decides. SQLAlchemy's events
tell :func:`pgbroker.transaction` when the caller commits (flush first) or rolls back (drop
what was buffered). See :mod:`pgbroker._produce.connectors` for the connectors' shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, scoped_session

__all__ = ["SQLAlchemyConnector", "driver_of", "listening"]

T = TypeVar("T")


class SQLAlchemyConnector:
    """A SQLAlchemy ``Session``, ``scoped_session`` or ``Connection`` (psycopg 3 driver)."""

    has_events = True

    @staticmethod
    def accepts(db: Any) -> bool:
        return isinstance(db, (scoped_session, Session, Connection))

    def __init__(self, db: Session | scoped_session[Any] | Connection):
        self.db = db

    def connection(self) -> psycopg.Connection[Any]:
        db: Any = self.db
        if isinstance(db, scoped_session):
            db = db()
        if isinstance(db, Session):
            db = db.connection()  # begins the session's transaction if none is open
        if not db.in_transaction():
            db.begin()  # what SQLAlchemy's autobegin does: the caller's commit ends it
        return driver_of(db, db.connection.driver_connection, psycopg.Connection)

    def hooks(self, flush: Callable[[], None],
              discard: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
        """Flush before a commit, discard at a rollback."""
        db = self.db() if isinstance(self.db, scoped_session) else self.db
        return listening(db, lambda *_: flush(), lambda *_: discard())


def driver_of(db: Any, driver: Any, kind: type[T]) -> T:
    """``driver``, the DBAPI connection under SQLAlchemy connection ``db``, if it is a psycopg
    ``kind`` (``Connection`` or ``AsyncConnection``); else the TypeError that says so."""
    if isinstance(driver, kind):
        return driver
    raise TypeError(
        f"pgbroker needs the psycopg 3 driver, but this SQLAlchemy connection uses "
        f"{db.dialect.name}+{db.dialect.driver}: create the engine with a "
        "postgresql+psycopg:// URL")


@contextlib.contextmanager
def listening(db: Session | Connection, on_flush: Callable[..., None],
              on_discard: Callable[..., None]) -> Iterator[None]:
    """While open, ``on_flush`` before ``db`` commits and ``on_discard`` at its rollback,
    called with the event's arguments (its first: the Session or Connection). A Session's
    events outlive its connections; a Connection's are its own."""
    listeners: list[tuple[Session | Connection, str, Callable[..., None]]]
    if isinstance(db, Session):
        listeners = [(db, "before_commit", on_flush), (db, "after_rollback", on_discard)]
    else:
        listeners = [(db, "commit", on_flush), (db, "rollback", on_discard)]
    for target, name, fn in listeners:
        event.listen(target, name, fn)
    try:
        yield
    finally:
        for target, name, fn in listeners:
            event.remove(target, name, fn)
