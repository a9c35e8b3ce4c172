"""``.delay()`` inside Django's ``atomic()``: written on Django's connection, in its transaction.

Opt in with the Django setting ``PGBROKER_JOIN_ATOMIC = True`` (pgbroker's Django app installs
:func:`sink_for` at start-up). Then a pgbroker publish (``.delay()``, ``.apply_async()``,
``send_task()``, a ``chain`` or ``group``) made outside any ``pgbroker.transaction()`` block,
while one of this thread's Django connections is inside ``atomic()`` and reaches the broker's
database, is INSERTed at once on that connection: the job exists exactly when the outermost
``atomic()`` commits, a rollback (of the block or of a savepoint around the publish) leaves no
job, and the wake-up NOTIFY is delivered at the commit. No ``transaction.on_commit`` and no
wrapper. Outside ``atomic()`` (Django's autocommit) nothing changes: the broker's own connection
writes, as without the setting.

Limits, stated honestly:

* The task id returned by ``apply_async`` is the new task's, also for an idempotent duplicate
  (``pgbroker.enqueue`` returns the existing job's id).
* A publish in a connection that reaches another database than the broker's (see
  :func:`pgbroker.contrib.django.conf.same_database`) is not joined: it goes to the broker's own
  connection as before, with a warning once per pair (system check ``pgbroker.W002``).
* A task's ``self.retry()`` called inside ``atomic()`` is a publish like any other: if the
  ``Retry`` exception then rolls the block back, the retry message goes with it and the task
  is not run again. Call ``retry`` outside the block (``autoretry_for`` does).
* Django's ``TestCase`` wraps each test in ``atomic()``: its publishes join the test's
  transaction and vanish with it; no worker can see them (``pgbroker.testing`` runs them).
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from ..._model.job import NewJob
from ..._pg.django_db import driver_connection
from ..._produce import write as _write
from ..._produce.transaction import add_ambient, remove_ambient
from ...settings import Settings
from . import conf

__all__ = ["AtomicSink", "install", "sink_for", "uninstall"]

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()


class AtomicSink:
    """Writes each publish at once on a Django connection, in its open transaction."""

    def __init__(self, conn: psycopg.Connection[Any]):
        self.conn = conn

    def add(self, job: NewJob, settings: Settings) -> None:
        _write.insert(self.conn, settings, job)

    def add_dead(self, job: NewJob, settings: Settings, error: str) -> None:
        _write.insert_dead(self.conn, settings, job, error)


def sink_for(conninfo: str) -> AtomicSink | None:
    """Where a publish to the broker at ``conninfo`` goes: the first of this thread's Django
    connections inside ``atomic()`` that reaches that database, else None."""
    # Django: imported by pgbroker's Django app only
    from django.db import connections

    for db in connections.all(initialized_only=True):
        if not db.in_atomic_block or db.vendor != "postgresql":
            continue
        if conf.same_database(conninfo, db):
            return AtomicSink(driver_connection(db))
        key = (conninfo, db.alias)
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "pgbroker: a task published inside atomic() on Django database %r is not part "
                "of that transaction: the broker's database is another (CELERY_BROKER_URL), so "
                "it is written at once by the broker's own connection", db.alias)
    return None


def install() -> None:
    """Join ``atomic()`` from now on (idempotent)."""
    add_ambient(sink_for)


def uninstall() -> None:
    remove_ambient(sink_for)
