"""The store of the hooks that write from inside Celery's processes, and their retried write.

The failure hook (:mod:`pgbroker._celery.failures`) and the endings hook
(:mod:`pgbroker._celery.endings`) write one fact into a delivery's row from whichever process Celery
calls them in (the worker's main process, a pool process, a thread): each process gets its own
connection, made on first use, and a write that finds the database unreachable is tried again on a
new connection for a while, since the ack that follows must find the fact written.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .._pg.store import Store
from ..errors import DatabaseUnavailable
from .app import find

__all__ = ["RECORD_FOR", "retrying", "store_for"]

#: Seconds a hook's write is retried on a new connection when the database cannot be reached.
RECORD_FOR = 30.0

_stores: dict[tuple[int, int, str], Store | None] = {}
_lock = threading.Lock()


def store_for(app: Any, application_name: str) -> Store | None:
    """This process's store for ``app``'s broker (None when the broker is not pgbroker)."""
    key = (os.getpid(), id(app), application_name)
    with _lock:
        if key not in _stores:
            broker = find(app)  # no I/O: just the options
            _stores[key] = None if broker is None else Store(
                broker.conninfo, dataclasses.replace(broker.settings, auto_migrate=False),
                application_name=application_name)
        return _stores[key]


def retrying(store: Store, write: Callable[[], object], within: float = RECORD_FOR) -> None:
    """``write()``, tried again on a new connection for up to ``within`` seconds while the
    database cannot be reached or the statement fails on a living connection (then that error
    is raised); any other error is raised at once."""
    deadline = time.monotonic() + within
    delay = 0.1
    while True:
        try:
            write()
            return
        except (DatabaseUnavailable, psycopg.OperationalError):
            # the connection lost, or a statement that failed on it (a full disk, a timeout):
            # both may pass
            store.close()
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
