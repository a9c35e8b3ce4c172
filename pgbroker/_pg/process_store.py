"""One store per process and database: the broker connections of a process share it.

A worker's consumer, its producer pool and their leases, or a web process's threads, all use
the same :class:`~pgbroker._pg.store.Store` (statements serialise on its lock), so that a worker
holds two connections (this one and its LISTEN one), not one per kombu connection.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..settings import Settings
from .store import Store

__all__ = ["acquire", "release"]

_shared: dict[tuple[int, str, Settings], list[Any]] = {}  # key -> [store, users]
_shared_lock = threading.Lock()


def acquire(conninfo: str, settings: Settings) -> Store:
    """This process's one store for ``conninfo`` and ``settings``: every broker connection of a
    process (a worker's consumer and its producer pool, a web process's threads) and their
    leases share its connection (statements serialise on its lock), so that a worker holds two
    connections (this one and its LISTEN one), not one per kombu connection. Counted: the
    connection closes when the last user calls :func:`release`."""
    key = (os.getpid(), conninfo, settings)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = [Store(conninfo, settings), 0]
        entry[1] += 1
        store: Store = entry[0]
        return store


def release(store: Store) -> None:
    """One user of an :func:`acquire` d store is done; the last one closes its connection (the
    store stays, and reconnects if it is acquired again)."""
    with _shared_lock:
        for entry in _shared.values():
            if entry[0] is store:
                entry[1] = max(0, entry[1] - 1)
                if entry[1]:
                    return
                break
    store.close()
