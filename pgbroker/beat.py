"""Celery beat on PostgreSQL: ``beat_scheduler = "pgbroker.beat:Scheduler"`` (or ``-S pgbroker``).

Celery's own beat must run as a single process: two of them fire every task twice, and one is a
single point of failure. This scheduler keeps each entry of ``beat_schedule`` as a row of
``<schema>.beat_schedule`` and fires an occurrence in one transaction: lock the entry row
(``FOR UPDATE SKIP LOCKED``), enqueue the job with :func:`pgbroker.enqueue` and the idempotency
key ``beat:<entry>:<occurrence, ISO 8601 UTC>``, move the row to its next occurrence, commit. Any
number of beat processes can therefore run at once: each occurrence is enqueued exactly once, and
when one beat dies the others carry on from the row it left.

Occurrences sit on a fixed grid, so a restart continues where the last beat left off:

* an interval (a number of seconds, a ``timedelta``, ``schedule(...)``) runs at the multiples of
  the interval counted from the Unix epoch (every 60 s: at each whole minute, UTC);
* ``crontab(...)`` runs at its own wall-clock minutes in the app's ``timezone`` (kept in the row);
* ``solar(...)`` runs at the event, to the second (needs ``ephem``: ``pgbroker[solar]``).

A new entry first fires at the first grid point after it is added.

Policies, set per entry in its ``options`` (and removed from them before the job is sent)::

    beat_schedule = {"report": {"task": "app.weekly_report", "schedule": crontab(0, 6, "mon"),
                                "options": {"misfire": "skip", "overlap": "queue"}}}

* ``misfire`` -- when beat finds that a later occurrence is already due too (no beat was running,
  or all stalled for a whole period): ``latest`` (default) fires once, for the latest occurrence
  due; ``skip`` fires nothing and waits for the first occurrence after now. Never one run per
  missed occurrence. An occurrence that is merely late (its successor is not due yet) fires.
* ``overlap`` -- while the previous occurrence's job (or its Celery retry) is still scheduled,
  pending or running: ``skip`` (default) drops the occurrence; ``queue`` keeps it waiting in the
  entry and enqueues it as soon as the previous job has finished (then the misfire policy applies
  if more time passed), so two runs never overlap even with many workers; ``allow`` enqueues it.

A task reads the occurrence it was fired for (a weekly report covers the week before it) as
``self.request.pgbroker_occurrence`` (ISO 8601, UTC; ``bind=True``), and its entry's name as
``self.request.pgbroker_beat_entry``: Celery copies message headers onto ``task.request``.

The table is the truth: beat reads it at every tick (at least every ``max_interval``, 5 s by
default), so entries added, changed, disabled or enabled at run time
(:class:`~pgbroker.schedules.Schedules`, ``pgbroker schedule ...``) are picked up without a
restart. The config is applied to it when a beat starts: new entries are added, changed ones
keep their history (runs, last occurrence, enabled) with the next occurrence recomputed from the
last one on the new grid, and entries no longer in the config are *kept but never fired*
(``removed_at``) until they come back or are deleted with ``pgbroker schedule delete``. Beats
starting with different configs: the last one to start wins. ``<schema>.beat_status`` gives,
per entry, the age of its last completed run.

Limits, stated honestly:

* Options are those of :func:`pgbroker.enqueue`: ``queue``, ``priority``, ``expires``,
  ``headers``, ``max_attempts``, ``countdown``. Others (``exchange``, ``routing_key``,
  ``time_limit``...) are refused at start-up; route with ``task_routes`` or ``queue``.
* args, kwargs and options are stored as JSON (kombu's, so dates round-trip): ``BeatLazyFunc``
  and other Python objects are refused.
* Times come from the database's clock, so beats on hosts with skewed clocks still agree. A
  beat ticks when the earliest occurrence is due, and at least every ``max_interval``.
* The heartbeat needs the jobs' rows: with ``retention`` 0 a job deleted at its ack is counted
  as completed when beat notices it is gone (within ``max_interval``).

This module is the :class:`Scheduler` only: when occurrences fall and what the policies decide
is :mod:`pgbroker._model.schedule` (pure), an entry's validation and row and the operator's
:class:`~pgbroker.schedules.Schedules` are :mod:`pgbroker.schedules`, and ``pgbroker schedule``
is :mod:`pgbroker.cli.schedule`.
"""


from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg
from celery import beat as celery_beat
from kombu.utils.json import loads as kombu_loads
from psycopg.rows import dict_row

from ._celery.app import broker_of
from ._model.schedule import (
    MISFIRE_POLICIES,
    OVERLAP_POLICIES,
    Plan,
    grid_from_spec,
    grid_of,
    iso_utc,
    occurrence_key,
    plan,
    zone_name,
)
from ._pg import driver as _db
from ._pg.catalogue import Queries
from ._pg.session import Session
from .enqueue import enqueue
from .errors import ConfigurationError
from .schedules import ENQUEUE_OPTIONS, EntryConfig, Schedules, entry_config, save_entry

__all__ = [
    "ENQUEUE_OPTIONS",
    "MISFIRE_POLICIES",
    "OCCURRENCE_HEADER",
    "OVERLAP_POLICIES",
    "Fired",
    "Scheduler",
    "Schedules",  # the operator's side, in pgbroker.schedules; importable from here too
]

logger = logging.getLogger(__name__)

#: What a database error while firing is called.
_WHAT = "pgbroker beat"

#: Message headers (so ``task.request`` attributes) of every job beat sends.
OCCURRENCE_HEADER = "pgbroker_occurrence"
ENTRY_HEADER = "pgbroker_beat_entry"

#: Set while a thread's scheduler applies its config (see Scheduler.setup_schedule).
_applying = threading.local()


@dataclasses.dataclass(frozen=True)
class Fired:
    """An occurrence enqueued by :meth:`Scheduler.run_once`."""

    entry: str
    task: str
    occurrence: datetime
    job_id: uuid.UUID

    @property
    def idempotency_key(self) -> str:
        return occurrence_key(self.entry, self.occurrence)



# -- the scheduler -------------------------------------------------------------------------------

class Scheduler(celery_beat.Scheduler):
    """Celery beat scheduler whose schedule and state live in PostgreSQL.

    Args:
        app: the Celery app; its broker must be ``pgbroker://``.
        now: a clock for tests (a callable returning an aware datetime); default: the
            database's.
        Other arguments as :class:`celery.beat.Scheduler` (``schedule_filename`` is ignored).

    ``schedule`` (Celery's attribute) holds the config's entries as read at start-up; their
    state, and the entries added at run time, are in the table.
    """

    #: Seconds between two reads of the table at most (when nothing is due sooner): how fast
    #: run-time changes are seen. ``beat_max_loop_interval`` or ``--max-interval`` override it.
    max_interval = 5.0
    #: Seconds before looking again at an entry another beat is firing right now.
    contended_interval = 0.2
    #: Seconds between looks at an entry held by overlap ``queue``.
    held_interval = 1.0
    #: Seconds before trying again when the database cannot be reached.
    retry_interval = 5.0

    def __init__(self, app: Any, *args: Any, now: Callable[[], datetime] | None = None,
                 **kwargs: Any):
        self._clock = now
        self._configs: dict[str, EntryConfig] = {}
        self._synced = False
        self._refreshed_at = 0.0
        broker = broker_of(app)  # without connecting; a ConfigurationError unless pgbroker's
        self.conninfo, self.settings = broker.conninfo, broker.settings
        self._q = Queries(self.settings.schema)
        # A beat frozen inside a firing (SIGSTOP, a hung host) must not keep its entry locked:
        # the others skip locked entries (beat_session)
        self._session = Session(self.conninfo, self.settings, application_name="pgbroker beat",
                                setup=lambda c: c.execute(self._q["beat_session"]))
        super().__init__(app, *args, **kwargs)

    # -- Celery's interface ----------------------------------------------------------------------

    def setup_schedule(self) -> None:
        """Read ``beat_schedule`` (plus Celery's default entries), validate every entry, and
        apply them to the table (retried at the next tick if the database is unreachable)."""
        self.data = {}
        tz = zone_name(self.app.timezone)
        for name, fields in (self.app.conf.beat_schedule or {}).items():
            try:
                grid_of(fields.get("schedule"), tz)  # a clearer error than Celery's for a bad one
                self.data[name] = self.Entry(**dict(fields, name=name, app=self.app))
            except (TypeError, ValueError, AttributeError) as exc:  # Celery's own checks
                raise ConfigurationError(f"beat entry {name!r}: {exc}") from exc
        self.install_default_entries(self.data)
        self._configs = {
            name: entry_config(name, e.task, e.schedule, e.args, e.kwargs, e.options, tz)
            for name, e in self.data.items()}
        if getattr(_applying, "config", False):
            # Built inside Celery's SIGTERM/SIGINT handler: a beat stopped while its first
            # scheduler applies the config reads Service.scheduler before it is set, so Celery
            # builds a second one on top of the first. The first holds the config lock until the
            # handler returns: waiting for it here would hang beat for good. Beat is stopping.
            return
        _applying.config = True
        try:
            self.sync_config()
        except _db.CONNECTION_ERRORS as exc:  # (a full disk too: a statement that failed)
            logger.error("beat: cannot apply beat_schedule yet (%s); trying again at every "
                         "tick", exc)
        finally:
            _applying.config = False

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: fire what is due; return the seconds to sleep. Never raises for a lost
        database: beat keeps trying every ``retry_interval`` seconds."""
        try:
            if not self._synced:
                self.sync_config()
            _fired, delay = self._run()
            if time.monotonic() - self._refreshed_at >= self.max_interval:
                self.refresh()
            return delay
        except _db.CONNECTION_ERRORS as exc:
            logger.error("beat: database unavailable (%s); trying again in %gs", exc,
                         self.retry_interval)
            self.close_connection()
            return min(self.retry_interval, self.max_interval)

    def sync(self) -> None:
        """Nothing to flush: every change is committed when it is made."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.close_connection()

    @property
    def info(self) -> str:
        return (f"    . db -> {_db.mask_password(_db.libpq_url(self.conninfo))} "
                f"(table {self.settings.schema}.beat_schedule)")

    # -- the work --------------------------------------------------------------------------------

    def run_once(self, now: datetime | None = None) -> list[Fired]:
        """Fire every due entry once (per its policies); return what was enqueued.

        ``now`` defaults to the scheduler's clock (the database's unless one was injected).
        """
        return self._run(now)[0]

    def sync_config(self, now: datetime | None = None) -> dict[str, list[str]]:
        """Apply the config's entries to the table (see the module docstring); returns the
        names ``added``, ``changed`` and ``removed``."""
        conn = self.connection()
        done: dict[str, list[str]] = {"added": [], "changed": [], "removed": []}
        what = "pgbroker beat config"
        with _db.translate_errors(what), conn.transaction():
            now = self._now(conn, now, what)
            self._q.execute(conn, "beat_sync_lock",
                            {"key": f"pgbroker.beat.{self.settings.schema}"}, what=what)
            rows = {r["name"]: r for r in self._q.dicts(conn, "beat_entry_all", what=what)}
            for name, cfg in self._configs.items():
                outcome = save_entry(conn, self._q, cfg, rows.get(name), "config", now,
                                     what=what)
                if outcome != "unchanged":
                    done[outcome].append(name)
            done["removed"] = [r[0] for r in self._q.all(
                conn, "beat_entry_remove", {"keep": list(self._configs)}, what=what)]
        self._synced = True
        for what, names in done.items():
            if names:
                logger.info("beat: %s entr%s %s", what, "y" if len(names) == 1 else "ies",
                            ", ".join(names))
        return done

    def refresh(self) -> int:
        """Record the completion of last jobs that finished (the heartbeat); returns how many."""
        with _db.translate_errors("pgbroker beat refresh"):
            n = self._q.rowcount(self.connection(), "beat_refresh", what="pgbroker beat refresh")
        self._refreshed_at = time.monotonic()
        return n

    def _run(self, now: datetime | None = None) -> tuple[list[Fired], float]:
        conn = self.connection()
        with _db.translate_errors(_WHAT):
            given = self._given(now)
            clock, due, upcoming = self._q.one(conn, "beat_due", {"now": given}, what=_WHAT)
        fired: list[Fired] = []
        soonest = [upcoming] if upcoming is not None else []
        floor = self.max_interval
        for name in due:
            outcome, result, next_occurrence = self._fire(conn, name, clock)
            if result is not None:
                fired.append(result)
            if next_occurrence is not None:
                soonest.append(next_occurrence)
            elif outcome == "held":
                floor = min(floor, self.held_interval)
            else:  # taken by another beat right now (or advanced by it since beat_due)
                floor = min(floor, self.contended_interval)
        delay = min([(t - clock).total_seconds() for t in soonest] + [floor])
        return fired, max(delay, 0.01)

    def _fire(self, conn: psycopg.Connection[Any], name: str, now: datetime
              ) -> tuple[str, Fired | None, datetime | None]:
        """Lock, decide, enqueue and advance one entry in one transaction.

        Returns (outcome, what was fired, the entry's next occurrence or None when it was left
        due). A failure other than the database's drops this occurrence, as Celery's beat does,
        with the error kept in the row: a bad entry never stops the others.
        """
        row = None
        try:
            with _db.translate_errors(_WHAT), conn.transaction():
                row = self._q.one(conn, "beat_entry_lock", {"name": name, "now": now},
                                  row_factory=dict_row, what=_WHAT)
                if row is None:
                    return "contended", None, None
                grid = grid_from_spec(row["schedule"])
                p = plan(grid, row["next_occurrence"], now, row["misfire"], row["overlap"],
                         row["previous_state"] == "pending")
                if p.outcome == "held":
                    return "held", None, None
                fired = None
                if p.fire is not None:
                    job_id = self._enqueue(conn, name, row, p.fire)
                    fired = Fired(name, row["task"], p.fire, job_id)
                self._advance(conn, name, row, p, fired)
        except _db.CONNECTION_ERRORS:
            raise
        except Exception as exc:  # see the docstring
            if row is None:
                raise
            return "error", None, self._failed(conn, name, row, now, exc)
        self._log(name, row, p, fired)
        return p.outcome, fired, p.next_occurrence

    def _enqueue(self, conn: psycopg.Connection[Any], name: str, row: Mapping[str, Any],
                 occurrence: datetime) -> uuid.UUID:
        options = kombu_loads(row["options"])
        headers = dict(options.pop("headers", None) or {})
        # celery_beat_task: the header Celery's own beat adds
        headers.update({"celery_beat_task": True, OCCURRENCE_HEADER: iso_utc(occurrence),
                        ENTRY_HEADER: name})
        return enqueue(conn, row["task"], kombu_loads(row["args"]), kombu_loads(row["kwargs"]),
                       idempotency_key=occurrence_key(name, occurrence), headers=headers,
                       app=self.app, **options)

    def _advance(self, conn: psycopg.Connection[Any], name: str, row: Mapping[str, Any],
                 p: Plan, fired: Fired | None, error: str | None = None) -> bool:
        return bool(self._q.rowcount(conn, "beat_entry_advance", {
            "name": name, "expected": row["next_occurrence"],
            "next_occurrence": p.next_occurrence,
            "fired": fired.occurrence if fired else None, "job_id": fired.job_id if fired else None,
            "previous_state": row.get("previous_state"),
            "previous_completed_at": row.get("previous_completed_at"),
            "error": error}, what=_WHAT))

    def _failed(self, conn: psycopg.Connection[Any], name: str, row: Mapping[str, Any],
                now: datetime, exc: Exception) -> datetime:
        """Drop the due occurrence of an entry that could not be sent; keep why."""
        error = f"{type(exc).__name__}: {exc}"
        try:
            grid = grid_from_spec(row["schedule"])
            next_occurrence = grid.next_after(grid.latest_at_or_before(now, row["next_occurrence"]))
        except Exception:  # noqa: BLE001 - an unreadable schedule: look again in a minute
            next_occurrence = now + timedelta(minutes=1)
        logger.error("beat: entry %r (%s) could not be sent, its occurrence is dropped: %s",
                     name, row["task"], error, exc_info=exc)
        with _db.translate_errors(_WHAT), conn.transaction():
            self._advance(conn, name, {"next_occurrence": row["next_occurrence"]},
                          Plan(None, next_occurrence, "error"), None, error)
        return next_occurrence

    def _log(self, name: str, row: Mapping[str, Any], p: Plan, fired: Fired | None) -> None:
        if fired is not None:
            # Celery's own wording, which operators grep for
            logger.info("Scheduler: Sending due task %s (%s) for %s", name, row["task"],
                        iso_utc(fired.occurrence))
        elif p.outcome == "missed":
            logger.warning("beat: entry %r missed its occurrence(s) from %s (misfire skip); next "
                           "at %s", name, iso_utc(row["next_occurrence"]),
                           iso_utc(p.next_occurrence))
        elif p.outcome == "overlap":
            logger.info("beat: entry %r skips an occurrence: its previous job has not finished "
                        "(overlap skip); next at %s", name, iso_utc(p.next_occurrence))

    # -- clock and connection --------------------------------------------------------------------

    def _given(self, now: datetime | None) -> datetime | None:
        """The injected time for this pass (argument, else the clock), or None: the database's."""
        if now is None and self._clock is not None:
            now = self._clock()
        if now is not None and now.tzinfo is None:
            raise ValueError(f"now must be an aware datetime, not {now!r}")
        return now

    def _now(self, conn: psycopg.Connection[Any], now: datetime | None, what: str) -> datetime:
        given = self._given(now)
        if given is not None:
            return given
        clock: datetime = self._q.one(conn, "beat_clock", what=what)[0]
        return clock

    def connection(self) -> psycopg.Connection[Any]:
        """The scheduler's own connection (autocommit; each firing is an explicit transaction),
        opened and kept by its session (migrated or checked, opened again after fork)."""
        return self._session.conn

    def close_connection(self) -> None:
        self._session.close()
