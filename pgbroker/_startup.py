"""What a Celery worker says once when it starts: diagnostics of its database.

Connected to Celery's ``worker_ready`` by ``import pgbroker``, so that a worker says it once per
start -- not every consumer: ``celery inspect`` and ``celery status`` consume (their reply
queue) too, and a warning on their stderr at every call is noise. Plain kombu consumers outside
a Celery worker are not told.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from celery import signals

from ._store import Store
from .transport import Transport

__all__ = ["connect", "warn_without_autovacuum"]

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()


def warn_without_autovacuum(store: Store) -> None:
    """Once per process and schema: say so when nothing will vacuum ``jobs``."""
    key = (store.conninfo, store.settings.schema)
    if key in _warned:
        return
    _warned.add(key)
    try:
        on = store.autovacuum_on()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the worker
        logger.debug("pgbroker: cannot tell whether autovacuum runs: %s", exc)
        return
    if not on:
        table = f"{store.settings.schema}.jobs"
        logger.warning(
            "pgbroker: autovacuum is off for %s. Every task leaves dead row versions behind that "
            "only VACUUM removes, and claims slow down as they pile up. Turn autovacuum on, or "
            "run 'VACUUM %s' every minute or so (docs/operations.md, \"Vacuum\").",
            table, table)


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Celery's ``worker_ready``: the worker's diagnostics, on a connection of their own."""
    transport = getattr(getattr(sender, "connection", None), "transport", None)
    if not isinstance(transport, Transport):
        return
    settings = dataclasses.replace(transport.settings, auto_migrate=False)
    store = Store(transport.conninfo, settings, application_name="pgbroker diagnostics")
    try:
        warn_without_autovacuum(store)
    finally:
        store.close()


def connect() -> None:
    """Connect :func:`on_worker_ready` to Celery's signal (done by ``import pgbroker``)."""
    signals.worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="pgbroker.startup")
