"""The sweeper: orphan rescue, expiry, promotion of due scheduled jobs, retention pruning, the
per-minute statistics of the admin page's charts, the folding of the duplicate-publish
counter, a VACUUM of the hot tables when autovacuum does not look after them, and a WARNING
when VACUUM's horizon is held too long (``xmin_warn_after``; :mod:`pgbroker._pg.vacuum`).

``Sweeper.run_once()`` does one pass and returns what it changed; it runs inside every consuming
worker (from its lease thread) and as ``pgbroker sweep``. ``run_once(now=...)`` does the pass as
if the database's clock read ``now`` (River's maintenance services take their clock the same
way), so a test builds a state -- a crashed worker's running rows, say -- and runs one pass at
the time it wants instead of waiting for the lease to run out. Several sweepers at once are safe:
every statement takes its rows with ``FOR UPDATE SKIP LOCKED`` and changes them only if they are
still in the state it found them in.

Limits, honestly: a job is rescued when its consumer's session advisory lock is gone (its
connection died: seconds) or its heartbeat is older than ``lease_timeout`` (a frozen or cut-off
worker). A worker that was only slow to heartbeat for longer than the lease will see its jobs run
again elsewhere; its own late acks then change nothing.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

import psycopg

from ._pg.store import Store
from ._pg.vacuum import HorizonGuard, VacuumFallback

__all__ = ["Sweeper", "SweepResult", "lock_class"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def lock_class(schema: str) -> int:
    """The first key of the consumers' advisory locks: one namespace per schema."""
    return zlib.crc32(f"pgbroker.consumers.{schema}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class SweepResult:
    """What one pass changed."""

    rescued: int = 0      # running jobs of lost consumers put back to pending
    buried: int = 0       # ... or to dead, their attempts used up
    consumers: int = 0    # lost consumers removed
    expired: int = 0      # pending/scheduled jobs past expires_at
    promoted: int = 0     # scheduled jobs that became due
    pruned: int = 0       # finished rows past the retention window
    queues: int = 0       # idle queues past their x-expires, deleted
    broadcasts: int = 0   # broadcast rows past their minute
    statistics: int = 0   # rows of the admin page's per-minute statistics written
    folded: int = 0       # duplicate-publish counter rows folded into one per queue
    keys: int = 0         # rows of concurrency keys idle for an hour, deleted
    vacuumed: int = 0     # hot tables whose VACUUM was started (autovacuum off for them)

    def __bool__(self) -> bool:
        return any(vars(self).values())


class Sweeper:
    """One pass of maintenance over a store's schema."""

    def __init__(self, store: Store, *, background_vacuum: bool = True):
        self.store = store
        self.lock_class = lock_class(store.settings.schema)
        self.horizon = HorizonGuard(store.settings)
        self.vacuum = VacuumFallback(store.conninfo, store.settings,
                                     background=background_vacuum)

    def run_once(self, prune_batches: int = 10, now: datetime | None = None) -> SweepResult:
        """Do one pass; prune at most ``prune_batches`` batches so a pass stays short.

        ``now`` (an aware datetime) is the time the pass acts at: heartbeats are older than the
        lease, messages expired, scheduled jobs due and rows past retention as measured from it.
        None (the default, and what every worker uses) is the database's ``now()``. What the
        pass writes (``updated_at``) and the per-minute statistics keep the real clock.

        Rows another session holds locked are skipped (SKIP LOCKED), and a step that still
        meets a lock gives up after ``MAINTENANCE_LOCK_TIMEOUT`` until the next pass: a lock
        left open in psql must not hold up the lease's heartbeats, which share this thread."""
        store = self.store
        rescued, buried, consumers = self._step("rescue", lambda: store.rescue(
            self.lock_class, now=now), (0, 0, 0))
        expired = self._step("expiry", lambda: store.expire(now=now), 0)
        promoted = self._step("promotion", lambda: store.promote_all(now=now), 0)
        pruned = 0
        for _ in range(prune_batches):
            n = self._step("pruning", lambda: store.prune(now=now), 0)
            pruned += n
            if n < store.settings.prune_batch_size:
                break
        queues = self._step("queue expiry", lambda: store.expire_queues(now=now), 0)
        broadcasts = self._step("broadcast pruning", lambda: store.prune_broadcasts(now=now), 0)
        # once a minute, by one sweeper; else it writes nothing
        statistics = self._step("statistics", store.rollup, 0)
        folded = self._step("duplicate folding", store.fold_duplicates, 0)
        keys = self._step("concurrency key pruning",
                          lambda: store.prune_concurrency_keys(now=now), 0)
        vacuumed = self._step("vacuum", lambda: self.vacuum.run_once(store.conn), 0)
        self._step("horizon check", lambda: self.horizon.check(store.conn, now=now), None)
        result = SweepResult(rescued, buried, consumers, expired, promoted, pruned, queues,
                             broadcasts, statistics, folded, keys, vacuumed)
        if rescued or buried:
            logger.warning("pgbroker sweeper: %d job(s) of lost consumers redelivered, %d dead, "
                           "%d consumer(s) removed", rescued, buried, consumers)
        elif result:
            # Forgetting consumers that held no job is routine: every `celery inspect` or
            # `celery status` leaves one behind when it exits without closing its connection.
            logger.debug("pgbroker sweeper: %s", result)
        return result

    def _step(self, what: str, run: Callable[[], T], skipped: T) -> T:
        try:
            return run()
        except psycopg.errors.LockNotAvailable:
            logger.warning("pgbroker sweeper: %s skipped until the next pass: another session "
                           "holds a lock it needs (a transaction left open?)", what)
            return skipped
