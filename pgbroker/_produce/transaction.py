"""Where a publish goes inside ``with pgbroker.transaction(db):`` or
``async with pgbroker.atransaction(db):``: the context variable and its buffer.

:func:`joined` (synchronous) and :func:`ajoined` (asyncio) open a :class:`Target` for ``db``
(through its connector, :mod:`pgbroker._produce.connectors`) and make it this context's; the
transport's ``Channel._put`` asks :func:`current_target` where to write: into the innermost open
target's buffer, or (None) the broker's own autocommit connection. The buffer is written by
:func:`pgbroker._produce.write.awrite` at the caller's commit (a library with commit events:
SQLAlchemy) or when the block is left.

Both blocks are one coroutine body (:func:`_block`), awaited by ``ajoined`` and run without an
event loop by ``joined`` (:mod:`pgbroker._pg.any_connection`). A publish (``.delay()``) is a
synchronous call even in asyncio code, so :meth:`Target.add` never waits for the database: an
asyncio block joins the caller's transaction when it is entered, a synchronous one at its first
publish.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from psycopg.pq import TransactionStatus

from .._model.job import NewJob
from .._pg import any_connection as _io
from ..settings import Settings
from . import write as _write
from .connectors import AsyncConnector, Connector, aconnector_for, connector_for

__all__ = ["Sink", "Target", "add_ambient", "ajoined", "current_target", "joined",
           "remove_ambient"]

logger = logging.getLogger("pgbroker.enqueue")  # transaction()'s messages, as they always were


class Target:
    """The jobs (and dead letters) published inside one ``pgbroker.transaction`` or
    ``pgbroker.atransaction`` block, waiting for its flush."""

    def __init__(self, connector: Connector | AsyncConnector, asynchronous: bool):
        self.connector = connector
        self.asynchronous = asynchronous
        self.name = "atransaction" if asynchronous else "transaction"
        self.raw = not connector.has_events  # no commit hook
        self._jobs: list[tuple[Settings, NewJob]] = []
        self._dead: list[tuple[Settings, NewJob, str]] = []

    async def connection(self) -> Any:
        return await _io.awaited(self.connector.connection())

    async def open(self) -> None:
        """Entering the block: refuse an unusable ``db`` now, not at the first publish."""
        if self.asynchronous:
            await self.join()
        else:
            await self.connection()

    async def join(self) -> None:
        """Join the transaction open now (SQLAlchemy: begin it), so that a rollback before the
        flush drops the jobs, and a psycopg one opened here lets flush() tell whether the caller
        ended it inside the block."""
        conn = await self.connection()
        if (self.raw and not conn.autocommit
                and conn.info.transaction_status == TransactionStatus.IDLE):
            await _io.awaited(conn.execute("SELECT 1"))

    def _joining(self) -> None:
        """At the first publish since the block began or flushed: join the transaction."""
        if self._jobs or self._dead:
            return
        if self.asynchronous:
            # no I/O here: the library's transaction only (after a commit inside the block, so
            # that a rollback event drops what this publish buffers)
            self.connector.begin()  # type: ignore[union-attr]
        else:
            _io.run_sync(self.join())

    def add(self, job: NewJob, settings: Settings) -> None:
        """Buffer one message (called by the transport's ``Channel._put``)."""
        self._joining()
        self._jobs.append((settings, job))

    def add_dead(self, job: NewJob, settings: Settings, error: str) -> None:
        """Buffer a dead letter (an unroutable message: ``job_insert_dead``), written with the
        block's jobs."""
        self._joining()
        self._dead.append((settings, job, error))

    async def flush(self) -> None:
        """Write what is buffered into the caller's current transaction (a statement a batch)."""
        if not (self._jobs or self._dead):
            return
        conn = await self.connection()
        if self.raw and not conn.autocommit and (
                conn.info.transaction_status != TransactionStatus.INTRANS):
            count = len(self._jobs) + len(self._dead)
            self.discard()
            raise RuntimeError(
                f"pgbroker.{self.name}: the connection's transaction ended inside the block, so "
                f"the {count} job(s) published in it were not written; commit (or roll back) "
                f"after leaving the `{'async ' if self.asynchronous else ''}with "
                f"pgbroker.{self.name}(conn):` block")
        (jobs, self._jobs), (dead, self._dead) = (self._jobs, []), (self._dead, [])
        if jobs:
            await _write.awrite(conn, jobs, _write.BATCH_SIZE)
        for settings, job, error in dead:
            await _write.ainsert_dead(conn, settings, job, error)

    async def flush_on_error(self) -> None:
        """Leaving by an exception: write into a still healthy transaction, else drop."""
        if not (self._jobs or self._dead):
            return
        try:
            conn = await self.connection()
            if conn.info.transaction_status == TransactionStatus.INERROR:
                self.discard()  # the transaction can only roll back
            else:
                await self.flush()
        except Exception as exc:  # noqa: BLE001 - the caller's own exception must propagate
            logger.warning("pgbroker.%s: %d job(s) not written while leaving the block on an "
                           "exception: %s", self.name, len(self._jobs) + len(self._dead), exc)
            self.discard()

    def discard(self) -> None:
        self._jobs.clear()
        self._dead.clear()

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        """The connector's commit and rollback events, flushing as its kind awaits."""
        if self.asynchronous:
            return self.connector.hooks(self.flush, self.discard)  # type: ignore[arg-type]
        return self.connector.hooks(lambda: _io.run_sync(self.flush()),  # type: ignore[arg-type]
                                    self.discard)


_target: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "pgbroker_transaction", default=None)


class Sink(Protocol):
    """Where a publish is written instead of the broker's own connection (a :class:`Target`)."""

    def add(self, job: NewJob, settings: Settings) -> None: ...

    def add_dead(self, job: NewJob, settings: Settings, error: str) -> None: ...


#: Where a publish goes outside any ``transaction()`` block when an integration says so:
#: callables given the broker's conninfo that return a sink, or None. pgbroker's Django app adds
#: one when the project opts in to joining ``atomic()`` (:mod:`pgbroker.contrib.django.atomic`).
_ambient: list[Callable[[str], Sink | None]] = []


def add_ambient(provider: Callable[[str], Sink | None]) -> None:
    """Ask ``provider`` where each publish outside a ``transaction()`` block goes."""
    if provider not in _ambient:
        _ambient.append(provider)


def remove_ambient(provider: Callable[[str], Sink | None]) -> None:
    if provider in _ambient:
        _ambient.remove(provider)


def current_target(conninfo: str | None = None) -> Sink | None:
    """Where the transport's ``Channel._put`` must write: the innermost open
    ``pgbroker.transaction`` or ``atransaction`` of this context, else what an ambient provider
    says for the broker at ``conninfo``, else None (the broker's own connection)."""
    target: Sink | None = _target.get()
    if target is None and conninfo is not None:
        for provider in _ambient:
            target = provider(conninfo)
            if target is not None:
                break
    return target


def joined(db: Any) -> contextlib.AbstractContextManager[None]:
    """The body of :func:`pgbroker.transaction`: publishes in this context go to ``db``'s
    buffer, written at its commit event or when the block is left (dropped if the transaction
    already failed, or at its rollback event)."""
    return _io.sync_context(_block(Target(connector_for(db), asynchronous=False)))


def ajoined(db: Any) -> contextlib.AbstractAsyncContextManager[None]:
    """The body of :func:`pgbroker.atransaction`: :func:`joined` for an asyncio ``db``."""
    return _block(Target(aconnector_for(db), asynchronous=True))


@contextlib.asynccontextmanager
async def _block(target: Target) -> AsyncIterator[None]:
    await target.open()
    token = _target.set(target)
    try:
        with target.hooks():
            try:
                yield
            except Exception:
                await target.flush_on_error()
                raise
            except BaseException:
                target.discard()
                raise
            await target.flush()
    finally:
        _target.reset(token)
