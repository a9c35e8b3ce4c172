"""Health checks for probes and monitors (``pgbroker health worker|queue|beat``).

Each check reads a few rows, by the database clock, and returns a :class:`Verdict`: ``ok``;
``stale``, what it checks is there but late (a heartbeat older than the lease, a job waiting too
long, a beat entry whose last run is overdue); or ``missing``, there is nothing to check (no such
consumer, no consumer alive for the queue, no such entry). ``pgbroker health`` prints the verdict
as one line of JSON and exits with :data:`EXIT_CODES` (0, 3, 4; 1 when the database cannot be
read, so nothing can be told).

* **worker** (liveness): a consumer of the host (and pid, or id) whose heartbeat is within the
  lease and whose session still holds its advisory lock -- what the sweeper tests before it
  redelivers a consumer's jobs. Limit: the heartbeat comes from the lease's own thread, so a
  worker whose event loop is stuck but whose process lives is still "alive" (as it is for the
  sweeper: its running jobs are not taken from it).
* **queue** (readiness): at least ``min_consumers`` consumers alive for the queue, and its oldest
  due job waiting no longer than ``max_pending_age``.
* **beat**: every enabled entry has completed a run since its latest occurrence that is more
  than ``grace`` seconds old (an entry every 60 s with 60 s of grace: a run completed within the
  last 60 to 120 s). An entry is owed nothing before its first occurrence after it was added.
* **vacuum**: nothing has held back VACUUM's horizon for longer than ``max_age`` seconds (or
  ``max_xid_age`` transactions: a replication slot, or another role's session seen without
  pg_read_all_stats, has no age in seconds); the holders and the hot tables' dead row versions
  are in the details (:mod:`pgbroker._pg.vacuum`).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg

from ._model.schedule import grid_from_spec
from ._pg.catalogue import Queries
from ._pg.vacuum import read as read_vacuum
from .errors import ConfigurationError
from .sweeper import lock_class

__all__ = ["EXIT_CODES", "Verdict", "beat", "queue", "vacuum", "worker"]

#: Exit status of ``pgbroker health`` per verdict.
EXIT_CODES = {"ok": 0, "stale": 3, "failing": 3, "missing": 4}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one check."""

    check: str     # worker, queue, beat, vacuum
    status: str    # ok, stale, failing, missing
    reason: str    # one sentence for a person
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def as_json(self) -> str:
        """One line of JSON: check, status, reason, then the details."""
        return json.dumps({"check": self.check, "status": self.status, "reason": self.reason,
                           **self.details}, default=_json_value, separators=(",", ":"))


def _json_value(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def _rows(conn: psycopg.Connection[Any], schema: str, name: str,
          params: dict[str, Any]) -> list[dict[str, Any]]:
    return Queries(schema).dicts(conn, name, params)


def _consumers(conn: psycopg.Connection[Any], schema: str, *, lease_timeout: float,
               **match: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(matching consumers, those alive) with a readable ``age`` each. Each is judged by its
    own lease (``lease_timeout`` is for a row of an older pgbroker, which has none)."""
    params = {"id": None, "host": None, "pid": None, "queue": None, **match,
              "lock_class": lock_class(schema), "lease": lease_timeout}
    found = _rows(conn, schema, "health_consumers", params)
    for row in found:
        row["heartbeat_age"] = round(row["heartbeat_age"], 1)
    alive = [r for r in found if r["connected"] and r["heartbeat_age"] <= r["lease_timeout"]]
    return found, alive


def worker(conn: psycopg.Connection[Any], schema: str = "pgbroker", *, host: str | None = None,
           pid: int | None = None, consumer: uuid.UUID | None = None,
           lease_timeout: float = 20.0, max_settle_failing: float = 30.0) -> Verdict:
    """Is a worker alive: a consumer of ``host`` (and ``pid``), or the consumer ``consumer``?
    Alive but failing: its acks have failed on a living connection for longer than
    ``max_settle_failing`` seconds (a full disk, a statement timeout: its jobs stay running)."""
    who = (f"consumer {consumer}" if consumer else
           f"host {host}" + (f" pid {pid}" if pid is not None else "") if host else
           f"pid {pid}" if pid is not None else "any host")
    found, alive = _consumers(conn, schema, lease_timeout=lease_timeout, id=consumer,
                              host=host, pid=pid)
    details = {"lease_timeout": lease_timeout, "consumers": [_consumer(r) for r in found]}
    failing = [r for r in alive if (r["settle_failing_for"] or 0) > max_settle_failing]
    if failing:
        return Verdict("worker", "failing", f"{len(failing)} consumer(s) of {who} alive, but "
                       f"their acks fail for {failing[0]['settle_failing_for']:.0f} s: "
                       f"{failing[0]['settle_error']}", details)
    if alive:
        return Verdict("worker", "ok", f"{len(alive)} consumer(s) of {who} alive, heartbeat "
                       f"{alive[0]['heartbeat_age']:g} s ago", details)
    if not found:
        return Verdict("worker", "missing", f"no consumer of {who} is registered (a worker "
                       "registers when it starts consuming)", details)
    newest = found[0]
    why = (f"heartbeat {newest['heartbeat_age']:g} s ago, over its "
           f"{newest['lease_timeout']:g} s lease"
           if newest["connected"] else "its database session is gone")
    return Verdict("worker", "stale", f"no consumer of {who} is alive: {why}", details)


def _consumer(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("id", "host", "pid", "queues", "heartbeat_age", "lease_timeout",
                                "connected", "settle_failing_for", "settle_error")}


def queue(conn: psycopg.Connection[Any], schema: str = "pgbroker", name: str = "celery", *,
          max_pending_age: float = 300.0, min_consumers: int = 1,
          lease_timeout: float = 20.0) -> Verdict:
    """Is the queue served: enough consumers alive, and no due job waiting too long?"""
    [row] = _rows(conn, schema, "health_queue", {"queue": name})
    _, alive = _consumers(conn, schema, lease_timeout=lease_timeout, queue=name)
    age = row["oldest_pending_age"]
    details = {"queue": name, "paused": row["paused"], "consumers_alive": len(alive),
               "oldest_pending_age": None if age is None else round(age, 1),
               "max_pending_age": max_pending_age, "min_consumers": min_consumers}
    paused = " (the queue is paused)" if row["paused"] else ""
    if not row["known"] and not alive:
        return Verdict("queue", "missing", f"unknown queue {name!r}: no consumer, no job",
                       details)
    if len(alive) < min_consumers:
        return Verdict("queue", "missing", f"{len(alive)} consumer(s) alive for queue {name!r},"
                       f" fewer than {min_consumers}", details)
    if age is not None and age > max_pending_age:
        return Verdict("queue", "stale", f"the oldest due job of queue {name!r} has waited "
                       f"{age:.0f} s, over {max_pending_age:g} s{paused}", details)
    return Verdict("queue", "ok", f"queue {name!r}: {len(alive)} consumer(s) alive, oldest due "
                   f"job {'none' if age is None else f'{age:.0f} s'}{paused}", details)


def beat(conn: psycopg.Connection[Any], schema: str = "pgbroker", entries: tuple[str, ...] = (),
         *, grace: float = 60.0) -> Verdict:
    """Is beat firing: has every enabled entry (or those named) completed its runs on time?"""
    rows = {r["name"]: r for r in _rows(conn, schema, "health_beat", {})}
    for name in entries:
        if name not in rows:
            state = next(iter(_rows(conn, schema, "health_beat_entry", {"name": name})), None)
            why = ("no such entry" if state is None else
                   "removed from the config" if state["removed"] else "disabled")
            return Verdict("beat", "missing", f"beat entry {name!r}: {why}", {"entry": name})
    checked = [rows[n] for n in entries] if entries else list(rows.values())
    if not checked:
        return Verdict("beat", "missing", "no enabled beat entry", {"entries": []})
    late, report = [], []
    for row in checked:
        owed = _owed_since(row, grace)
        done = row["last_completed_at"]
        ok = owed is None or (done is not None and done >= owed)
        age = None if done is None else round((row["now"] - done).total_seconds(), 1)
        report.append({"entry": row["name"], "ok": ok, "last_completed_age": age,
                       "owed_since": owed, "last_job_state": row["last_job_state"]})
        if not ok:
            late.append(f"{row['name']} (last completed run: "
                        f"{'never' if age is None else f'{age:.0f} s ago'}; owed one since "
                        f"{owed:%Y-%m-%d %H:%M:%S} UTC)")
    details = {"grace": grace, "entries": report}
    if late:
        return Verdict("beat", "stale", f"{len(late)} beat entr{'y' if len(late) == 1 else 'ies'}"
                       f" overdue: {'; '.join(late)}", details)
    return Verdict("beat", "ok", f"{len(checked)} beat entr{'y' if len(checked) == 1 else 'ies'}"
                   " on time", details)


def _owed_since(row: dict[str, Any], grace: float) -> datetime | None:
    """The latest occurrence more than ``grace`` seconds ago, whose run must have completed by
    now; None when no occurrence is owed yet (the entry's first one is more recent)."""
    try:
        grid = grid_from_spec(row["schedule"])
    except ConfigurationError:  # an unreadable schedule: beat does not fire it either
        return None
    deadline = row["now"] - timedelta(seconds=grace)
    first = grid.next_after(row["created_at"])
    if first > deadline:
        return None
    return grid.latest_at_or_before(deadline, first)


def vacuum(conn: psycopg.Connection[Any], schema: str = "pgbroker", *, max_age: float = 300.0,
           max_xid_age: int | None = None) -> Verdict:
    """Is VACUUM's horizon held too long: a transaction or snapshot open for more than
    ``max_age`` seconds, or an xmin more than ``max_xid_age`` transactions old?"""
    report = read_vacuum(conn, schema)
    details = {"max_age": max_age, "max_xid_age": max_xid_age, **report.as_dict()}
    held = [h for h in report.holders if h.tables]
    late = [h for h in held if (h.age is not None and h.age > max_age)
            or (max_xid_age is not None and h.xid_age > max_xid_age)]
    if late:
        return Verdict("vacuum", "stale", f"VACUUM's horizon is held by {late[0].describe()}, "
                       f"over {max_age:g} s" + (f" or {max_xid_age} transactions"
                                                 if max_xid_age is not None else ""), details)
    if not held:
        return Verdict("vacuum", "ok", "nothing holds back VACUUM's horizon", details)
    return Verdict("vacuum", "ok", f"VACUUM's horizon is held by {held[0].describe()}", details)
