"""VACUUM's side of a queue: what holds back its horizon, the hot tables' dead row versions, the
worker's warning about a horizon held too long, and a VACUUM of the hot tables when autovacuum
does not run.

Every claim and ack leaves a dead row version, and VACUUM removes none that died after the
oldest transaction or snapshot still open anywhere (a report, ``pg_dump``, a forgotten
``BEGIN``, a replication slot, a standby's ``hot_standby_feedback``): the claims then walk more
and more of them. :func:`read` says who holds the horizon and how the hot tables stand (the
statements ``horizon_holders`` and ``hot_tables_vacuum`` of ``sql/health.sql``); ``pgbroker
stats``, ``pgbroker health vacuum``, ``/metrics`` and the admin page show it.
:class:`HorizonGuard` (the sweeper, once per pass) logs a WARNING once per holder held longer
than ``xmin_warn_after``. :class:`VacuumFallback` (the sweeper) vacuums a hot table that
autovacuum does not look after once it has as many dead versions as autovacuum's own trigger
would allow.

Limits, honestly: without ``pg_read_all_stats`` another role's session shows its pid,
application and xids, but not its state, start or query: its age in seconds is then how long
this process has seen it hold the same xmin. The age in seconds of a session is since its
transaction began, which for a READ COMMITTED transaction running many short statements is more
than it holds the horizon (its age in XIDs is exact). A manual ``VACUUM`` in a session shows as
a holder, though it holds back no other VACUUM.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from ..settings import Settings
from . import driver as _db
from .catalogue import Queries

__all__ = ["HOT_TABLES", "Holder", "HorizonGuard", "HotTable", "VacuumFallback",
           "VacuumReport", "read"]

logger = logging.getLogger(__name__)

#: pgbroker's tables whose rows are updated or deleted all the time (migration 0015); jobs by
#: its partitions (0020): the jobs to run, and the finished ones the sweeper prunes.
HOT_TABLES = ("jobs_live", "jobs_done", "consumers", "queues", "concurrency_keys", "rate_limits",
              "broadcasts", "task_losses")

#: What pg_stat_activity shows for another role's query without pg_read_all_stats.
HIDDEN = "<insufficient privilege>"

#: Seconds between two VACUUMs of one table by the fallback (by anyone: the table's last vacuum
#: time is the database's): a VACUUM cannot remove what a held horizon keeps, and would
#: otherwise run again at every pass for nothing.
VACUUM_INTERVAL = 60.0

#: Seconds between two looks of one process's fallback at the hot tables.
VACUUM_CHECK_INTERVAL = 15.0

#: Seconds a fallback VACUUM waits for any lock (the tables' own: SKIP_LOCKED does not wait).
VACUUM_LOCK_TIMEOUT = 1.0


@dataclasses.dataclass(frozen=True)
class Holder:
    """One thing that holds back VACUUM's horizon (a row of ``horizon_holders``)."""

    kind: str               #: transaction, snapshot, prepared transaction, replication slot,
    #: replication slot (catalogs), standby
    pid: int | None
    name: str | None        #: application_name, prepared gid, slot or standby name
    database: str | None    #: its database, when another one (None: this one, or none)
    state: str | None
    since: datetime | None  #: its transaction's start (prepared: when it was prepared)
    age: float | None       #: seconds since ``since``
    xid_age: int            #: transactions since the xmin it holds
    xmin: str               #: the xmin it holds
    query: str | None

    @property
    def hidden(self) -> bool:
        """Its state, start and query are hidden from this role (no pg_read_all_stats)."""
        return self.query == HIDDEN

    @property
    def tables(self) -> bool:
        """It holds back pgbroker's tables (a logical slot's catalog_xmin holds catalogs only)."""
        return self.kind != "replication slot (catalogs)"

    def first_line(self, width: int = 80) -> str:
        """The first line of its query, cut at ``width``; '' when there is none to show."""
        text = (self.query or "").strip()
        line = text.splitlines()[0] if text and not self.hidden else ""
        return line if len(line) <= width else line[:width - 1] + "…"

    def describe(self) -> str:
        """One line for a person: what, who, since when, doing what."""
        who = " ".join(p for p in (f"pid {self.pid}" if self.pid is not None else "",
                                   repr(self.name or "")) if p)
        age = "" if self.age is None else f"{self.age:.0f} s, "
        state = f", {self.state}" if self.state else ""
        if self.database:
            state += f", in database {self.database}"
        query = (": query hidden (grant pg_read_all_stats to see it)" if self.hidden else
                 f": {self.first_line()}" if self.first_line() else "")
        return f"{self.kind} {who}{state} ({age}{self.xid_age} transactions old){query}"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "query": self.first_line(200) or None,
                "hidden": self.hidden}


@dataclasses.dataclass(frozen=True)
class HotTable:
    """One hot table's row versions and vacuums (a row of ``hot_tables_vacuum``)."""

    table: str
    live: int
    dead: int
    last_vacuum: datetime | None
    last_autovacuum: datetime | None
    vacuumed_at: datetime | None  #: the later of the two
    autovacuum: bool              #: autovacuum looks after it
    due: bool                     #: the fallback would vacuum it now


@dataclasses.dataclass(frozen=True)
class VacuumReport:
    """Who holds VACUUM's horizon (oldest first, at most a few) and how the hot tables stand."""

    holders: list[Holder]
    tables: list[HotTable]

    @property
    def oldest(self) -> Holder | None:
        """The oldest holder of pgbroker's tables' horizon."""
        return next((h for h in self.holders if h.tables), None)

    @property
    def age(self) -> float | None:
        """Seconds the horizon has been held, as far as can be seen (None: nothing known)."""
        ages = [h.age for h in self.holders if h.tables and h.age is not None]
        return max(ages) if ages else None

    @property
    def hidden(self) -> bool:
        """Some holder's state, start and query are hidden from this role."""
        return any(h.hidden for h in self.holders)

    def as_dict(self) -> dict[str, Any]:
        oldest = self.oldest
        return {"horizon_age_seconds": self.age,
                "horizon_age_xids": oldest.xid_age if oldest else None,
                "holders": [h.as_dict() for h in self.holders],
                "hidden": self.hidden,
                "tables": [dataclasses.asdict(t) for t in self.tables]}


def holders(conn: psycopg.Connection[Any], schema: str, *, now: datetime | None = None,
            limit: int = 5) -> list[Holder]:
    """The ``limit`` oldest holders of VACUUM's horizon; ``now`` is the clock of their ages."""
    rows = Queries(schema).dicts(conn, "horizon_holders", {"now": now, "limit": limit})
    return [Holder(**{**r, "xmin": str(r["xmin"])}) for r in rows]


def tables(conn: psycopg.Connection[Any], schema: str) -> list[HotTable]:
    """How the hot tables stand (:data:`HOT_TABLES`)."""
    rows = Queries(schema).dicts(conn, "hot_tables_vacuum", {
        "schema": schema, "tables": list(HOT_TABLES), "interval": VACUUM_INTERVAL})
    return [HotTable(**r) for r in rows]


def read(conn: psycopg.Connection[Any], schema: str, *, now: datetime | None = None,
         limit: int = 5) -> VacuumReport:
    """Who holds VACUUM's horizon, and how pgbroker's hot tables stand."""
    return VacuumReport(holders(conn, schema, now=now, limit=limit), tables(conn, schema))


def advice(holder: Holder) -> str:
    """What to do about ``holder``, for the worker's warning."""
    if holder.kind == "prepared transaction":
        return (f"finish it: COMMIT PREPARED '{holder.name}' or ROLLBACK PREPARED "
                f"'{holder.name}'")
    if holder.kind.startswith("replication slot"):
        return (f"if its consumer is gone, drop it: SELECT pg_drop_replication_slot("
                f"'{holder.name}')")
    if holder.kind == "standby":
        return ("a long query on that standby holds it (hot_standby_feedback): end it, or "
                "turn hot_standby_feedback off there (replay then cancels what it conflicts "
                "with)")
    return (f"end it if it is forgotten (SELECT pg_terminate_backend({holder.pid})); set "
            "idle_in_transaction_session_timeout, run reports and pg_dump on a replica "
            "(README, \"Long transactions and VACUUM\")")


class HorizonGuard:
    """The worker's warning: once per holder held longer than ``settings.xmin_warn_after``."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.enabled = True  #: off in a remote-control client (pgbroker._consume.lease)
        self._first_seen: dict[tuple[Any, ...], float] = {}  # holders seen, by this clock
        self._warned: set[tuple[Any, ...]] = set()

    def check(self, conn: psycopg.Connection[Any], now: datetime | None = None) -> list[Holder]:
        """Look once (``now``: the clock, None for the database's); warn of the holders held
        too long not warned of yet, and return them."""
        after = self.settings.xmin_warn_after
        if not after or not self.enabled:
            return []
        clock = now.timestamp() if now is not None else time.time()
        found = [h for h in holders(conn, self.settings.schema, now=now) if h.tables]
        keys = {}
        for h in found:
            # one holder: its session and transaction; its held xmin when its start is hidden
            keys[(h.kind, h.pid, h.name, h.since or h.xmin)] = h
        self._first_seen = {k: self._first_seen.get(k, clock) for k in keys}
        self._warned &= set(keys)
        warned = []
        for key, h in keys.items():
            held = h.age if h.age is not None else clock - self._first_seen[key]
            if held < after or key in self._warned:
                continue
            self._warned.add(key)
            warned.append(h)
            seen = "" if h.age is not None else " at least (seen by this worker that long)"
            logger.warning(
                "pgbroker: VACUUM's horizon has been held for %.0f s%s by %s. No row version "
                "that died since can be removed, in any table of the database: claims slow "
                "down as dead versions pile up in %s.jobs_live. What to do: %s.",
                held, seen, h.describe(), self.settings.schema, advice(h))
        return warned


class VacuumFallback:
    """A VACUUM of the hot tables that autovacuum does not look after (the server's autovacuum
    or track_counts is off, or the table's autovacuum_enabled), once one has as many dead row
    versions as autovacuum's own trigger would allow (migration 0015's settings), at most once
    a minute per table. It runs on a connection of its own, in a thread of its own unless
    ``background`` is false: a VACUUM of a large ``jobs`` takes seconds, and the sweeper shares
    its thread with the lease's heartbeats. It never waits for a table's lock (SKIP_LOCKED: a
    table another VACUUM or a lock holds is left for the next time)."""

    def __init__(self, conninfo: str, settings: Settings, *, background: bool = True):
        self.conninfo = conninfo
        self.settings = settings
        self.background = background
        self.enabled = True  #: off in a remote-control client (pgbroker._consume.lease)
        self._next_check = 0.0
        self._thread: threading.Thread | None = None
        self._refused: set[str] = set()  # tables this role may not vacuum (warned once)

    def run_once(self, conn: psycopg.Connection[Any]) -> int:
        """Look at the hot tables over ``conn`` (at most every VACUUM_CHECK_INTERVAL) and
        vacuum those due; returns how many VACUUMs were started (or, not in the background,
        done)."""
        if (not self.enabled or time.monotonic() < self._next_check
                or (self._thread and self._thread.is_alive())):
            return 0
        self._next_check = time.monotonic() + VACUUM_CHECK_INTERVAL
        due = [t for t in tables(conn, self.settings.schema)
               if t.due and t.table not in self._refused]
        if not due:
            return 0
        if not self.background:
            return self.vacuum(due)
        self._thread = threading.Thread(target=self.vacuum, args=(due,), daemon=True,
                                        name="pgbroker-vacuum")
        self._thread.start()
        return len(due)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a VACUUM in the background to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    def vacuum(self, due: Sequence[HotTable]) -> int:
        """VACUUM each of ``due``; returns how many were vacuumed (not skipped)."""
        skipped: list[str] = []
        done = []
        try:
            conn = _db.connect(self.conninfo, connect_timeout=self.settings.connect_timeout,
                               application_name="pgbroker vacuum")
        except Exception as exc:  # noqa: BLE001 - tried again at a later pass
            logger.debug("pgbroker vacuum: cannot connect: %s", exc)
            return 0
        # VACUUM (SKIP_LOCKED) says what it skipped as a WARNING notice, not an error
        conn.add_notice_handler(lambda d: skipped.append(d.message_primary or ""))
        try:
            conn.execute("SELECT set_config('lock_timeout', %s, false)",
                         (f"{int(VACUUM_LOCK_TIMEOUT * 1000)}ms",))
            for t in due:
                del skipped[:]
                try:
                    conn.execute(sql.SQL("VACUUM (SKIP_LOCKED) {}").format(
                        sql.Identifier(self.settings.schema, t.table)), prepare=False)
                except psycopg.errors.LockNotAvailable:
                    skipped.append("lock not available")
                if any(w in s for s in skipped for w in ("owner", "privilege", "permission")):
                    self._refused.add(t.table)
                    logger.warning("pgbroker: cannot vacuum %s.%s (%s), and autovacuum does not: "
                                   "vacuum it as its owner, or turn autovacuum on",
                                   self.settings.schema, t.table, skipped[0])
                elif skipped:
                    logger.debug("pgbroker vacuum: %s skipped: %s", t.table, skipped[0])
                else:
                    done.append(f"{t.table} ({t.dead} dead)")
        except Exception as exc:  # noqa: BLE001 - tried again at a later pass
            logger.warning("pgbroker vacuum: %s", str(exc).strip().splitlines()[0])
        finally:
            _db.close(conn)
        if done:
            logger.info("pgbroker: vacuumed %s of schema %s (autovacuum does not look after "
                        "them)", ", ".join(done), self.settings.schema)
        return len(done)
