"""VACUUM's side of a queue: what holds back its horizon, and the hot tables' dead row versions.

Every claim and ack leaves a dead row version, and VACUUM removes none that died after the
oldest transaction or snapshot still open anywhere (a report, ``pg_dump``, a forgotten
``BEGIN``, a replication slot, a standby's ``hot_standby_feedback``): the claims then walk more
and more of them. :func:`read` says who holds the horizon and how the hot tables stand (the
statements ``horizon_holders`` and ``hot_tables_vacuum`` of ``sql/health.sql``); ``pgbroker
stats``, ``pgbroker health vacuum``, ``/metrics`` and the admin page show it.

Limits, honestly: without ``pg_read_all_stats`` another role's session shows its pid,
application and xids, but not its state, start or query: its age in seconds is then unknown,
its age in XIDs is still exact. The age in seconds of a session is since its
transaction began, which for a READ COMMITTED transaction running many short statements is more
than it holds the horizon (its age in XIDs is exact). A manual ``VACUUM`` in a session shows as
a holder, though it holds back no other VACUUM.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime
from typing import Any

import psycopg

from ._sql import Queries

__all__ = ["HOT_TABLES", "Holder", "HotTable", "VacuumReport", "read"]

logger = logging.getLogger(__name__)

#: pgbroker's tables whose rows are updated or deleted all the time (migration 0015).
HOT_TABLES = ("jobs", "consumers", "queues", "concurrency_keys", "rate_limits", "broadcasts",
              "task_losses")

#: What pg_stat_activity shows for another role's query without pg_read_all_stats.
HIDDEN = "<insufficient privilege>"

#: Seconds between two VACUUMs of one table by a fallback when autovacuum is off (by anyone:
#: the table's last vacuum time is the database's): a VACUUM cannot remove what a held horizon
#: keeps, and would otherwise run again and again for nothing.
VACUUM_INTERVAL = 60.0

@dataclasses.dataclass(frozen=True)
class Holder:
    """One thing that holds back VACUUM's horizon (a row of ``horizon_holders``)."""

    kind: str               #: transaction, snapshot, prepared transaction, replication slot,
    #: replication slot (catalogs), standby
    pid: int | None
    name: str | None        #: application_name, prepared gid, slot or standby name
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
    due: bool                     #: not looked after, and due for a VACUUM


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
