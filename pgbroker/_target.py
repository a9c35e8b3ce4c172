"""Where a publish goes inside ``with pgbroker.transaction(db):``: the context variable and its
buffer.

:func:`joined` opens a :class:`Target` for ``db`` (through its connector,
:mod:`pgbroker._connector`) and makes it this context's; the transport's ``Channel._put`` asks
:func:`current_target` where to write: into the innermost open target's buffer, or (None) the
broker's own autocommit connection. The buffer is written by :func:`pgbroker._write.write` at the
caller's commit (a library with commit events: SQLAlchemy) or when the block is left.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

from psycopg.pq import TransactionStatus

from . import _write
from ._connector import connector_for
from ._jobs import NewJob
from .settings import Settings

__all__ = ["Target", "current_target", "joined"]

logger = logging.getLogger("pgbroker.enqueue")  # transaction()'s messages, as they always were


class Target:
    """The jobs published inside one ``pgbroker.transaction`` block, waiting for its flush."""

    def __init__(self, db: Any):
        self.db = db
        self.connector = connector_for(db)  # refuse an unsupported db now, not at the first publish
        self.raw = not self.connector.has_events  # no commit hook
        self._jobs: list[tuple[Settings, NewJob]] = []
        self.connector.connection()

    def add(self, job: NewJob, settings: Settings) -> None:
        """Buffer one message (called by the transport's ``Channel._put``)."""
        if not self._jobs:
            # Join the transaction open now (SQLAlchemy: begin it), so that a rollback before
            # the flush drops these jobs, and a psycopg one opened here lets flush() tell
            # whether the caller ended it inside the block.
            conn = self.connector.connection()
            if (self.raw and not conn.autocommit
                    and conn.info.transaction_status == TransactionStatus.IDLE):
                conn.execute("SELECT 1")
        self._jobs.append((settings, job))

    def add_dead(self, job: NewJob, settings: Settings, error: str) -> None:
        """Write a dead letter (an unroutable message: ``job_insert_dead``) into the caller's
        transaction now."""
        _write.insert_dead(self.connector.connection(), settings, job, error)

    def flush(self) -> None:
        """Write what is buffered into the caller's current transaction (a statement a batch)."""
        if not self._jobs:
            return
        conn = self.connector.connection()
        if self.raw and not conn.autocommit and (
                conn.info.transaction_status != TransactionStatus.INTRANS):
            count = len(self._jobs)
            self._jobs.clear()
            raise RuntimeError(
                f"pgbroker.transaction: the connection's transaction ended inside the block, so "
                f"the {count} job(s) published in it were not written; commit (or roll back) "
                "after leaving the `with pgbroker.transaction(conn):` block")
        jobs, self._jobs = self._jobs, []
        _write.write(conn, jobs, _write.BATCH_SIZE)

    def flush_on_error(self) -> None:
        """Leaving by an exception: write into a still healthy transaction, else drop."""
        if not self._jobs:
            return
        try:
            status = self.connector.connection().info.transaction_status
            if status == TransactionStatus.INERROR:
                self.discard()  # the transaction can only roll back
            else:
                self.flush()
        except Exception as exc:  # noqa: BLE001 - the caller's own exception must propagate
            logger.warning("pgbroker.transaction: %d job(s) not written while leaving the block "
                           "on an exception: %s", len(self._jobs), exc)
            self.discard()

    def discard(self) -> None:
        self._jobs.clear()


_target: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "pgbroker_transaction", default=None)


def current_target() -> Target | None:
    """Where the transport's ``Channel._put`` must write: the innermost open
    ``pgbroker.transaction`` of this context, or None (the broker's own connection)."""
    return _target.get()


@contextlib.contextmanager
def joined(db: Any) -> Iterator[None]:
    """The body of :func:`pgbroker.transaction`: publishes in this context go to ``db``'s
    buffer, written at its commit event or when the block is left (dropped if the transaction
    already failed, or at its rollback event)."""
    target = Target(db)
    token = _target.set(target)
    try:
        with target.connector.hooks(target.flush, target.discard):
            try:
                yield
            except Exception:
                target.flush_on_error()
                raise
            except BaseException:
                target.discard()
                raise
            target.flush()
    finally:
        _target.reset(token)
