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
default), so entries added, changed, disabled or enabled at run time (:class:`Schedules`,
``pgbroker schedule ...``) are picked up without a restart. The config is applied to it when a
beat starts: new entries are added, changed ones keep their history (runs, last occurrence,
enabled) with the next occurrence recomputed from the last one on the new grid, and entries no
longer in the config are *kept but never fired* (``removed_at``) until they come back or are
deleted with ``pgbroker schedule delete``. Beats starting with different configs: the last one
to start wins. ``<schema>.beat_status`` gives, per entry, the age of its last completed run.

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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from celery import beat as celery_beat
from celery import schedules as celery_schedules
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import _db
from ._sql import queries
from .enqueue import enqueue
from .errors import ConfigurationError, DatabaseUnavailable
from .settings import Settings

__all__ = [
    "ENQUEUE_OPTIONS",
    "MISFIRE_POLICIES",
    "OCCURRENCE_HEADER",
    "OVERLAP_POLICIES",
    "Fired",
    "Scheduler",
    "Schedules",
    "register_cli",
]

logger = logging.getLogger(__name__)

MISFIRE_POLICIES = ("latest", "skip")
OVERLAP_POLICIES = ("skip", "queue", "allow")
#: The entry options passed on to :func:`pgbroker.enqueue` (``misfire``/``overlap`` are beat's).
ENQUEUE_OPTIONS = frozenset({"queue", "priority", "expires", "headers", "max_attempts",
                             "countdown"})
#: Message headers (so ``task.request`` attributes) of every job beat sends.
OCCURRENCE_HEADER = "pgbroker_occurrence"
ENTRY_HEADER = "pgbroker_beat_entry"

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)

#: Set while a thread's scheduler applies its config (see Scheduler.setup_schedule).
_applying = threading.local()


# -- grids: when the occurrences of a schedule fall ---------------------------------------------

class Grid:
    """The occurrences of one schedule: a strictly increasing sequence of UTC datetimes."""

    spec: dict[str, Any]  #: the JSON stored in ``beat_schedule.schedule``

    def next_after(self, t: datetime) -> datetime:
        """The first occurrence strictly after ``t``."""
        raise NotImplementedError

    def latest_at_or_before(self, now: datetime, start: datetime) -> datetime:
        """The last occurrence at or before ``now``, given an occurrence ``start <= now``.

        Searches back from ``now`` in doubling windows, then walks forward: a few steps however
        long beat was down (one per occurrence only within the last empty window).
        """
        best, window = start, timedelta(minutes=1)
        while now - window > best:
            candidate = self.next_after(now - window)
            if candidate <= now:
                best = candidate
                break
            window *= 2
        while (following := self.next_after(best)) <= now:
            best = following
        return best

    def describe(self) -> str:
        raise NotImplementedError


class Every(Grid):
    """Every ``period``, on the multiples of it counted from the Unix epoch (UTC)."""

    def __init__(self, period: timedelta):
        if period < timedelta(milliseconds=1):
            raise ConfigurationError(f"an interval must be at least 1 ms, not {period}")
        self.period_us = period // _MICROSECOND
        self.spec = {"every": period.total_seconds()}

    def next_after(self, t: datetime) -> datetime:
        k = (t - EPOCH) // _MICROSECOND // self.period_us + 1
        return EPOCH + timedelta(microseconds=k * self.period_us)

    def latest_at_or_before(self, now: datetime, start: datetime) -> datetime:
        k = (now - EPOCH) // _MICROSECOND // self.period_us  # closed form: no search
        return EPOCH + timedelta(microseconds=k * self.period_us)

    def describe(self) -> str:
        return f"every {self.spec['every']:g}s"


class Cron(Grid):
    """A crontab in a time zone, computed by Celery's own crontab arithmetic."""

    FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")  # cron's order

    def __init__(self, fields: Mapping[str, str], tz: str):
        try:
            self.zone = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"unknown time zone {tz!r} for a crontab: use an IANA name "
                                     "such as 'UTC' or 'Europe/Paris'") from exc
        values = {f: str(fields.get(f, "*")) for f in self.FIELDS}
        unknown = set(fields) - set(self.FIELDS)
        if unknown:
            raise ConfigurationError(f"unknown crontab field(s) {sorted(unknown)}")
        try:
            self.cron = celery_schedules.crontab(**values, nowfun=lambda: datetime.now(self.zone))
        except (ValueError, TypeError, celery_schedules.ParseException) as exc:
            raise ConfigurationError(f"invalid crontab {' '.join(values.values())!r}: {exc}") \
                from exc
        self.cron.tz = self.zone  # Celery's crontab reads the app's zone otherwise
        self.spec = {"crontab": values, "tz": tz}

    def next_after(self, t: datetime) -> datetime:
        probe = t
        for _ in range(4):
            last, delta, _now = self.cron.remaining_delta(probe.astimezone(self.zone),
                                                          tz=self.zone)
            found = (last + delta).astimezone(timezone.utc)
            if found > t:
                return found
            # A wall-clock step that lands on or before t (a repeated hour when clocks go
            # back): look again a minute later.
            probe += timedelta(minutes=1)
        raise RuntimeError(f"crontab {self.describe()} has no occurrence after {t}")

    def describe(self) -> str:
        return f"crontab {' '.join(self.spec['crontab'].values())} ({self.spec['tz']})"


class Solar(Grid):
    """A solar event at a place, to the second, computed by Celery's ``solar`` (``ephem``)."""

    def __init__(self, event: str, lat: float, lon: float):
        try:
            self.solar = celery_schedules.solar(event, lat, lon)
        except Exception as exc:  # ImproperlyConfigured (no ephem), ValueError
            raise ConfigurationError(f"invalid solar schedule: {exc}") from exc
        self.spec = {"solar": {"event": event, "lat": lat, "lon": lon}}

    def next_after(self, t: datetime) -> datetime:
        start = t
        for _ in range(2):
            found = self._event_after(start)
            if found > t:
                return found
            # t is this very event, cut to the second: the next one is a day or so later
            start = t + timedelta(minutes=1)
        raise RuntimeError(f"{self.describe()} has no occurrence after {t}")

    def _event_after(self, t: datetime) -> datetime:
        """The event after t, cut to the second (so that keys and logs read well)."""
        start = t.astimezone(timezone.utc).replace(tzinfo=None)
        self.solar.cal.date = start
        event = self.solar._next_event(self.solar.ephem.Date(start)).datetime()
        return event.replace(tzinfo=timezone.utc, microsecond=0)

    def describe(self) -> str:
        s = self.spec["solar"]
        return f"solar {s['event']} at {s['lat']}, {s['lon']}"


def grid_of(schedule: Any, tz: str = "UTC") -> Grid:
    """The grid of a ``beat_schedule`` schedule: seconds, ``timedelta``, ``schedule``,
    ``crontab`` (in time zone ``tz``) or ``solar``."""
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return Every(timedelta(seconds=schedule))
    if isinstance(schedule, timedelta):
        return Every(schedule)
    if isinstance(schedule, celery_schedules.crontab):
        return Cron({f: _cron_field(getattr(schedule, f"_orig_{f}")) for f in Cron.FIELDS}, tz)
    if isinstance(schedule, celery_schedules.solar):
        return Solar(schedule.event, schedule.lat, schedule.lon)
    if isinstance(schedule, celery_schedules.schedule):
        return Every(schedule.run_every)
    raise ConfigurationError(
        f"schedule {schedule!r} ({type(schedule).__name__}) cannot be stored in PostgreSQL: use "
        "a number of seconds, a timedelta, celery.schedules.schedule, crontab or solar")


def grid_from_spec(spec: Mapping[str, Any]) -> Grid:
    """The grid of a stored ``beat_schedule.schedule`` value."""
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"stored schedule {spec!r} is not an object")
    if "every" in spec:
        return Every(timedelta(seconds=float(spec["every"])))
    if "crontab" in spec:
        return Cron(spec["crontab"], spec.get("tz") or "UTC")
    if "solar" in spec:
        s = spec["solar"]
        return Solar(s["event"], s["lat"], s["lon"])
    raise ConfigurationError(f"stored schedule {spec!r} is neither every, crontab nor solar")


def _cron_field(value: Any) -> str:
    """A crontab field as Celery's parser reads it back ('*/5', '1,15', 'mon-fri')."""
    if isinstance(value, (set, frozenset, list, tuple, range)):
        return ",".join(str(v) for v in sorted(value))
    return str(value)


def _zone_name(zone: Any) -> str:
    """The IANA name of a Celery app's time zone (stored with its crontabs)."""
    if zone is timezone.utc:
        return "UTC"
    name = getattr(zone, "key", None)
    if not name:
        raise ConfigurationError(f"the app's time zone {zone!r} has no IANA name: set "
                                 "timezone = 'Europe/Paris' (say) in the Celery config")
    return str(name)


# -- deciding one occurrence ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do with a due entry: fire ``fire`` (or nothing) and move to ``next_occurrence``.

    ``outcome``: ``fired``; ``missed`` (misfire ``skip``); ``overlap`` (overlap ``skip``);
    ``held`` (overlap ``queue``: the row is left as it is, due, until the previous job ends).
    """

    fire: datetime | None
    next_occurrence: datetime
    outcome: str


def plan(grid: Grid, due: datetime, now: datetime, misfire: str, overlap: str,
         previous_unfinished: bool) -> Plan:
    """Apply the misfire and overlap policies to an entry whose next occurrence ``due`` is
    at or before ``now``. Pure: the unit of every policy test."""
    following = grid.next_after(due)
    if now < following:
        occurrence = due  # on time, or late within its own period
    elif misfire == "skip":
        return Plan(None, grid.next_after(now), "missed")
    else:  # latest: once, for the latest occurrence due
        occurrence = grid.latest_at_or_before(now, following)
    if previous_unfinished and overlap == "queue":
        return Plan(None, due, "held")
    if previous_unfinished and overlap == "skip":
        return Plan(None, grid.next_after(occurrence), "overlap")
    return Plan(occurrence, grid.next_after(occurrence), "fired")


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


def occurrence_key(entry: str, occurrence: datetime) -> str:
    """The idempotency key of one occurrence: ``beat:<entry>:<ISO 8601 UTC>``."""
    return f"beat:{entry}:{_iso(occurrence)}"


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat()


# -- entries: validated, as rows -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EntryConfig:
    """One entry, validated and serialised as its row's columns."""

    name: str
    task: str
    args: str      # kombu JSON
    kwargs: str
    options: str
    grid: Grid
    misfire: str
    overlap: str

    def params(self, source: str, next_occurrence: datetime, enabled: bool = True
               ) -> dict[str, Any]:
        return {"name": self.name, "task": self.task, "args": self.args, "kwargs": self.kwargs,
                "options": self.options, "schedule": Jsonb(self.grid.spec),
                "misfire": self.misfire, "overlap": self.overlap, "source": source,
                "enabled": enabled, "next_occurrence": next_occurrence}

    def same_as(self, row: Mapping[str, Any]) -> bool:
        """True when the stored row already says exactly this (nothing to update)."""
        return (row["task"] == self.task and row["misfire"] == self.misfire
                and row["overlap"] == self.overlap and row["schedule"] == self.grid.spec
                and all(json.loads(row[k]) == json.loads(getattr(self, k))
                        for k in ("args", "kwargs", "options")))


def entry_config(name: str, task: str, schedule: Any, args: Any = (), kwargs: Any = None,
                 options: Mapping[str, Any] | None = None, tz: str = "UTC") -> EntryConfig:
    """Validate one entry; :class:`ConfigurationError` says what is wrong with which entry."""
    from .enqueue import _check_options  # enqueue's own option checks, run at start-up

    try:
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ConfigurationError("the entry name must be a non-empty string of at most "
                                     "200 characters")
        if not isinstance(task, str) or not task:
            raise ConfigurationError(f"task must be a task name, not {task!r}")
        args = [] if args is None else args
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(args, (list, tuple)):
            raise ConfigurationError(f"args must be a list or tuple, not {type(args).__name__}")
        if not isinstance(kwargs, Mapping):
            raise ConfigurationError(f"kwargs must be a mapping, not {type(kwargs).__name__}")
        opts = dict(options or {})
        misfire = opts.pop("misfire", "latest")
        overlap = opts.pop("overlap", "skip")
        if misfire not in MISFIRE_POLICIES:
            raise ConfigurationError(f"misfire must be one of {', '.join(MISFIRE_POLICIES)}, "
                                     f"not {misfire!r}")
        if overlap not in OVERLAP_POLICIES:
            raise ConfigurationError(f"overlap must be one of {', '.join(OVERLAP_POLICIES)}, "
                                     f"not {overlap!r}")
        unknown = set(opts) - ENQUEUE_OPTIONS
        if unknown:
            raise ConfigurationError(
                f"option(s) {sorted(unknown)} are not supported by pgbroker's beat (supported: "
                f"{', '.join(sorted(ENQUEUE_OPTIONS | {'misfire', 'overlap'}))}; route with "
                "task_routes or 'queue')")
        _check_options(opts)
        attempts = opts.get("max_attempts")
        if attempts is not None and (not isinstance(attempts, int) or isinstance(attempts, bool)
                                     or attempts < 1):
            raise ConfigurationError(f"max_attempts must be a positive integer, not {attempts!r}")
        grid = grid_of(schedule, tz)
        try:
            serialised = [kombu_dumps(v) for v in (list(args), dict(kwargs), opts)]
        except TypeError as exc:
            raise ConfigurationError(f"args, kwargs and options must be JSON-serialisable (they "
                                     f"are stored in PostgreSQL): {exc}") from exc
    except ValueError as exc:  # ConfigurationError and enqueue's MessageError are ValueErrors
        raise ConfigurationError(f"beat entry {name!r}: {exc}") from exc
    return EntryConfig(name, task, *serialised, grid=grid, misfire=misfire, overlap=overlap)


def _save(conn: psycopg.Connection[Any], q: Mapping[str, str], cfg: EntryConfig,
          row: Mapping[str, Any] | None, source: str, now: datetime,
          enabled: bool = True) -> str:
    """Insert or update one entry inside the caller's transaction (``row``: the locked row, if
    any). Returns ``added``, ``changed`` or ``unchanged``."""
    if row is None:
        conn.execute(q["beat_entry_insert"],
                     cfg.params(source, cfg.grid.next_after(now), enabled))
        return "added"
    if cfg.same_as(row) and row["source"] == source and row["removed_at"] is None:
        return "unchanged"
    next_occurrence = row["next_occurrence"]
    if row["schedule"] != cfg.grid.spec:
        # a new grid: continue from the last occurrence fired (history kept), never before it
        next_occurrence = cfg.grid.next_after(row["last_occurrence"] or now)
    conn.execute(q["beat_entry_configure"], cfg.params(source, next_occurrence))
    return "changed"


def _broker(app: Any) -> tuple[str, Settings]:
    """(conninfo, settings) of ``app``'s pgbroker broker, without connecting."""
    from .enqueue import _settings  # ConfigurationError unless the broker is pgbroker
    from .transport import Transport

    settings = _settings(app)
    return Transport._conninfo(app.connection_for_write()), settings


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
        self._conn: psycopg.Connection[Any] | None = None
        self._configs: dict[str, EntryConfig] = {}
        self._synced = False
        self._refreshed_at = 0.0
        self.conninfo, self.settings = _broker(app)
        self._q = queries(self.settings.schema)
        super().__init__(app, *args, **kwargs)

    # -- Celery's interface ----------------------------------------------------------------------

    def setup_schedule(self) -> None:
        """Read ``beat_schedule`` (plus Celery's default entries), validate every entry, and
        apply them to the table (retried at the next tick if the database is unreachable)."""
        self.data = {}
        tz = _zone_name(self.app.timezone)
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
        except DatabaseUnavailable as exc:
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
        with _db.translate_errors("pgbroker beat config"), conn.transaction():
            now = self._now(conn, now)
            conn.execute(self._q["beat_sync_lock"], {"key": f"pgbroker.beat.{self.settings.schema}"})
            rows = {r["name"]: r for r in conn.cursor(row_factory=dict_row).execute(
                self._q["beat_entry_all"])}
            for name, cfg in self._configs.items():
                outcome = _save(conn, self._q, cfg, rows.get(name), "config", now)
                if outcome != "unchanged":
                    done[outcome].append(name)
            done["removed"] = [r[0] for r in conn.execute(self._q["beat_entry_remove"],
                                                          {"keep": list(self._configs)})]
        self._synced = True
        for what, names in done.items():
            if names:
                logger.info("beat: %s entr%s %s", what, "y" if len(names) == 1 else "ies",
                            ", ".join(names))
        return done

    def refresh(self) -> int:
        """Record the completion of last jobs that finished (the heartbeat); returns how many."""
        with _db.translate_errors("pgbroker beat refresh"):
            n = self.connection().execute(self._q["beat_refresh"]).rowcount
        self._refreshed_at = time.monotonic()
        return n

    def _run(self, now: datetime | None = None) -> tuple[list[Fired], float]:
        conn = self.connection()
        with _db.translate_errors("pgbroker beat"):
            given = self._given(now)
            clock, due, upcoming = conn.execute(self._q["beat_due"], {"now": given}).fetchone()
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
            with _db.translate_errors("pgbroker beat"), conn.transaction():
                row = conn.cursor(row_factory=dict_row).execute(
                    self._q["beat_entry_lock"], {"name": name, "now": now}).fetchone()
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
        headers.update({"celery_beat_task": True, OCCURRENCE_HEADER: _iso(occurrence),
                        ENTRY_HEADER: name})
        return enqueue(conn, row["task"], kombu_loads(row["args"]), kombu_loads(row["kwargs"]),
                       idempotency_key=occurrence_key(name, occurrence), headers=headers,
                       app=self.app, **options)

    def _advance(self, conn: psycopg.Connection[Any], name: str, row: Mapping[str, Any],
                 p: Plan, fired: Fired | None, error: str | None = None) -> bool:
        return bool(conn.execute(self._q["beat_entry_advance"], {
            "name": name, "expected": row["next_occurrence"],
            "next_occurrence": p.next_occurrence,
            "fired": fired.occurrence if fired else None, "job_id": fired.job_id if fired else None,
            "previous_state": row.get("previous_state"),
            "previous_completed_at": row.get("previous_completed_at"),
            "error": error}).rowcount)

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
        with _db.translate_errors("pgbroker beat"), conn.transaction():
            self._advance(conn, name, {"next_occurrence": row["next_occurrence"]},
                          Plan(None, next_occurrence, "error"), None, error)
        return next_occurrence

    def _log(self, name: str, row: Mapping[str, Any], p: Plan, fired: Fired | None) -> None:
        if fired is not None:
            # Celery's own wording, which operators grep for
            logger.info("Scheduler: Sending due task %s (%s) for %s", name, row["task"],
                        _iso(fired.occurrence))
        elif p.outcome == "missed":
            logger.warning("beat: entry %r missed its occurrence(s) from %s (misfire skip); next "
                           "at %s", name, _iso(row["next_occurrence"]), _iso(p.next_occurrence))
        elif p.outcome == "overlap":
            logger.info("beat: entry %r skips an occurrence: its previous job has not finished "
                        "(overlap skip); next at %s", name, _iso(p.next_occurrence))

    # -- clock and connection --------------------------------------------------------------------

    def _given(self, now: datetime | None) -> datetime | None:
        """The injected time for this pass (argument, else the clock), or None: the database's."""
        if now is None and self._clock is not None:
            now = self._clock()
        if now is not None and now.tzinfo is None:
            raise ValueError(f"now must be an aware datetime, not {now!r}")
        return now

    def _now(self, conn: psycopg.Connection[Any], now: datetime | None) -> datetime:
        given = self._given(now)
        if given is not None:
            return given
        return conn.execute(self._q["beat_clock"]).fetchone()[0]

    def connection(self) -> psycopg.Connection[Any]:
        """The scheduler's own connection (autocommit; each firing is an explicit transaction)."""
        if _db.owned(self._conn):
            assert self._conn is not None
            return self._conn
        from ._store import ensure_migrated
        from .migrate import check

        if self.settings.auto_migrate:
            ensure_migrated(self.conninfo, self.settings.schema)
        conn = _db.connect(self.conninfo, connect_timeout=self.settings.connect_timeout,
                           application_name="pgbroker beat")
        try:
            with _db.translate_errors("pgbroker beat"):
                if not self.settings.auto_migrate:
                    check(conn, self.settings.schema)
                # A beat frozen inside a firing (SIGSTOP, a hung host) must not keep its entry
                # locked: the others skip locked entries.
                conn.execute(self._q["beat_session"])
        except BaseException:
            _db.close(conn)
            raise
        self._conn = conn
        return conn

    def close_connection(self) -> None:
        _db.close(self._conn)
        self._conn = None


# -- the operator's side -------------------------------------------------------------------------

class Schedules:
    """List, add, change, enable, disable and delete entries at run time, audited.

    Beats pick the changes up at their next tick. Entries from the ``beat_schedule`` config can
    be enabled and disabled here (that survives restarts) but are changed in the config.
    Mistakes raise :class:`pgbroker.ops.OperationError`; nothing has changed then.
    """

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "pgbroker", *,
                 actor: str, via: str):
        self.conn = conn
        self.schema = Settings(schema=schema).schema  # validates the name
        self.q = queries(self.schema)
        self.actor = actor
        self.via = via

    def list(self) -> list[dict[str, Any]]:
        """Every entry with its state and heartbeat (``schedule``: a readable description)."""
        with _db.translate_errors("pgbroker beat_list"):
            rows = self.conn.cursor(row_factory=dict_row).execute(self.q["beat_list"]).fetchall()
        for row in rows:
            try:
                row["schedule"] = grid_from_spec(row["schedule"]).describe()
            except ConfigurationError as exc:
                row["schedule"] = f"invalid: {exc}"
        return rows

    def set_enabled(self, name: str, enabled: bool) -> bool:
        """Enable or disable an entry; False when it already was. A re-enabled entry whose
        occurrences passed meanwhile follows its misfire policy (``latest``: fires once)."""
        with self._action() as row_of:
            row_of(name)
            changed = bool(self.conn.execute(self.q["beat_entry_set_enabled"],
                                             {"name": name, "enabled": enabled}).rowcount)
            self._audit("schedule.enable" if enabled else "schedule.disable", name,
                        {"changed": changed})
        if changed:
            logger.info("pgbroker: %s %s schedule entry %r", self.actor,
                        "enabled" if enabled else "disabled", name)
        return changed

    def run_now(self, name: str) -> datetime:
        """Have the beats fire an enabled entry at their next tick (within ``max_interval``),
        as an occurrence of now; returns that time. The entry's next occurrence on its grid
        stays what it was (run now adds a run, it skips none), and its policies apply: with
        ``overlap`` ``skip`` it is dropped while the previous run is unfinished. With no beat
        running, nothing fires until one starts."""
        from .ops import OperationError

        with self._action() as row_of:
            row_of(name)
            row = self.conn.execute(self.q["beat_entry_run_now"], {"name": name}).fetchone()
            if row is None:
                raise OperationError(f"schedule entry {name!r} is disabled or no longer in the "
                                     "config: enable it first")
            self._audit("schedule.run_now", name, {"at": row[0].isoformat()})
        logger.info("pgbroker: %s asked for a run of schedule entry %r now", self.actor, name)
        return row[0]

    def add(self, name: str, task: str, schedule: Any, args: Any = (), kwargs: Any = None,
            options: Mapping[str, Any] | None = None, *, tz: str = "UTC", enabled: bool = True,
            replace: bool = False) -> str:
        """Add an entry (``replace``: or change an entry added at run time, keeping its
        history); returns ``added``, ``changed`` or ``unchanged``."""
        from .ops import OperationError

        try:
            cfg = entry_config(name, task, schedule, args, kwargs, options, tz)
        except ConfigurationError as exc:
            raise OperationError(str(exc)) from exc
        with self._action() as row_of:
            row = row_of(name, missing_ok=True)
            if row is not None and row["source"] == "config" and row["removed_at"] is None:
                raise OperationError(f"schedule entry {name!r} comes from the beat_schedule "
                                     "config: change it there (beat applies it when it "
                                     "starts); enable and disable work on it here")
            if row is not None and not replace:
                raise OperationError(f"schedule entry {name!r} exists: add --replace to change "
                                     "it (its history is kept)")
            now = self.conn.execute(self.q["beat_clock"]).fetchone()[0]
            outcome = _save(self.conn, self.q, cfg, row, "runtime", now, enabled)
            if outcome != "unchanged":
                self._audit(f"schedule.{'add' if outcome == 'added' else 'change'}", name, {
                    "task": task, "schedule": cfg.grid.describe(), "args": json.loads(cfg.args),
                    "kwargs": json.loads(cfg.kwargs), "options": json.loads(cfg.options),
                    "misfire": cfg.misfire, "overlap": cfg.overlap})
        return outcome

    def delete(self, name: str) -> None:
        """Delete an entry added at run time, or a config entry no longer in the config."""
        from .ops import OperationError

        with self._action() as row_of:
            row = row_of(name)
            assert row is not None  # row_of raised otherwise
            if row["source"] == "config" and row["removed_at"] is None:
                raise OperationError(f"schedule entry {name!r} comes from the beat_schedule "
                                     "config: remove it there (it is then kept, never fired, "
                                     "until deleted here), or disable it")
            gone = self.conn.cursor(row_factory=dict_row).execute(
                self.q["beat_entry_delete"], {"name": name}).fetchone()
            self._audit("schedule.delete", name, {k: v for k, v in gone.items() if k != "name"})
        logger.info("pgbroker: %s deleted schedule entry %r", self.actor, name)

    @contextlib.contextmanager
    def _action(self) -> Iterator[Callable[..., Any]]:
        """One transaction: lock the entry, change it, write the audit row."""
        from .ops import OperationError

        def row_of(name: str, missing_ok: bool = False) -> dict[str, Any] | None:
            row = self.conn.cursor(row_factory=dict_row).execute(
                self.q["beat_entry_get"], {"name": name}).fetchone()
            if row is None and not missing_ok:
                known = [r[0] for r in self.conn.execute(self.q["beat_names"])]
                hint = f"known: {', '.join(known[:20])}" if known else "there is none"
                raise OperationError(f"no schedule entry {name!r} ({hint})")
            return row

        with _db.translate_errors("pgbroker schedule"), self.conn.transaction():
            yield row_of

    def _audit(self, action: str, name: str, detail: dict[str, Any]) -> None:
        self.conn.execute(self.q["audit_insert"], {
            "actor": self.actor, "action": action, "target": f"schedule:{name}",
            "detail": Jsonb({"via": self.via, **detail},
                            dumps=lambda obj: json.dumps(obj, default=str))})


# -- command line (``pgbroker schedule ...``, registered by pgbroker.cli) ------------------------

def register_cli(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """Add ``schedule list|add|enable|disable|delete`` to the ``pgbroker`` command line.

    ``parents``: the parser(s) giving ``--database-url`` and ``--schema`` after the command.
    Errors follow :mod:`pgbroker.cli`: :class:`pgbroker.ops.OperationError` (exit 2) for a
    mistake, :class:`DatabaseUnavailable` (exit 1) for the database.
    """
    parents = list(parents)
    text = "Beat's periodic schedule: list entries, add or change one, enable, disable, delete."
    top = subparsers.add_parser("schedule", help=text, description=text, parents=parents)
    sub = top.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)

    def action(name: str, func: Callable[[Schedules, argparse.Namespace], int],
               help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=parents)
        p.set_defaults(func=_with_schedules(func))
        return p

    p = action("list", _cmd_list, "List the entries: schedule, next and last occurrence, runs, "
               "the last job's state and when a run last completed.")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    for verb, func, help in (
            ("enable", _cmd_enable, ("Enable an entry: beats fire it again from their next tick "
                                     "(missed occurrences follow its misfire policy).")),
            ("disable", _cmd_disable, ("Disable an entry: beats stop firing it at their next "
                                       "tick; kept across restarts until enabled.")),
            ("delete", _cmd_delete, ("Delete an entry added at run time, or one removed from "
                                     "the beat_schedule config."))):
        action(verb, func, help).add_argument("name", metavar="NAME")
    p = action("add", _cmd_add, "Add an entry at run time (or change one with --replace); "
               "beats pick it up at their next tick.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("task", metavar="TASK", help="the Celery task name")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--every", type=float, metavar="SECONDS",
                      help="an interval, on multiples of it counted from the Unix epoch")
    when.add_argument("--crontab", metavar="'M H DOM MON DOW'",
                      help="a crontab expression, e.g. '*/15 * * * *'")
    p.add_argument("--tz", default="UTC", help="the crontab's time zone (default: UTC)")
    p.add_argument("--args", default="[]", metavar="JSON", help="positional arguments, a JSON "
                   "list")
    p.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments, a JSON "
                   "object")
    p.add_argument("--queue", help="queue (default: the app's routing)")
    p.add_argument("--priority", type=int, help="priority, 0-255 (higher first)")
    p.add_argument("--expires", type=float, metavar="SECONDS",
                   help="discard a job not started this long after it was sent")
    p.add_argument("--misfire", choices=MISFIRE_POLICIES, default="latest",
                   help="after downtime: fire once (latest, default) or wait (skip)")
    p.add_argument("--overlap", choices=OVERLAP_POLICIES, default="skip",
                   help="while the previous run is unfinished: skip (default), queue or allow")
    p.add_argument("--disabled", action="store_true", help="add it disabled")
    p.add_argument("--replace", action="store_true", help="change the entry if it exists")


def _with_schedules(handler: Callable[[Schedules, argparse.Namespace], int]
                    ) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from .cli import _connect  # the CLI's connection: URL, schema check, errors
        from .ops import os_user

        with contextlib.closing(_connect(args)) as conn:
            return handler(Schedules(conn, args.schema, actor=os_user(), via="cli"), args)

    return run


def _cmd_list(schedules: Schedules, args: argparse.Namespace) -> int:
    from .cli import _json, _table

    rows = schedules.list()
    if args.json:
        print(_json(rows))
        return 0

    def state(row: dict[str, Any]) -> str:
        if row["removed_at"] is not None:
            return "removed"
        return "enabled" if row["enabled"] else "disabled"

    print(_table(["NAME", "TASK", "SCHEDULE", "STATE", "NEXT", "LAST", "RUNS", "LAST JOB",
                  "COMPLETED AGO", "POLICIES", "ERROR"],
                 [[r["name"], r["task"], r["schedule"], state(r), r["next_occurrence"],
                   r["last_occurrence"], r["total_runs"], r["last_job_state"],
                   None if r["age_seconds"] is None else f"{r['age_seconds']:.0f}s",
                   f"misfire {r['misfire']}, overlap {r['overlap']}",
                   (r["last_error"] or "")[:60]] for r in rows]))
    return 0


def _cmd_enable(schedules: Schedules, args: argparse.Namespace) -> int:
    changed = schedules.set_enabled(args.name, True)
    print(f"schedule entry {args.name} {'enabled' if changed else 'was already enabled'}")
    return 0


def _cmd_disable(schedules: Schedules, args: argparse.Namespace) -> int:
    changed = schedules.set_enabled(args.name, False)
    print(f"schedule entry {args.name} {'disabled' if changed else 'was already disabled'}")
    return 0


def _cmd_delete(schedules: Schedules, args: argparse.Namespace) -> int:
    schedules.delete(args.name)
    print(f"schedule entry {args.name} deleted")
    return 0


def _cmd_add(schedules: Schedules, args: argparse.Namespace) -> int:
    from .ops import OperationError

    parsed = {}
    for key in ("args", "kwargs"):
        try:
            parsed[key] = json.loads(getattr(args, key))
        except ValueError as exc:
            raise OperationError(f"--{key} is not JSON: {exc}") from None
    if args.crontab is not None:
        fields = args.crontab.split()
        if len(fields) != 5:
            raise OperationError(f"--crontab needs 5 fields (minute hour day-of-month month "
                                 f"day-of-week), not {args.crontab!r}")
        try:
            schedule: Any = celery_schedules.crontab.from_string(" ".join(fields))
        except (ValueError, celery_schedules.ParseException) as exc:
            raise OperationError(f"invalid --crontab {args.crontab!r}: {exc}") from None
    else:
        schedule = args.every
    options = {k: getattr(args, k) for k in ("queue", "priority", "expires")
               if getattr(args, k) is not None}
    outcome = schedules.add(args.name, args.task, schedule, parsed["args"], parsed["kwargs"],
                            {**options, "misfire": args.misfire, "overlap": args.overlap},
                            tz=args.tz, enabled=not args.disabled, replace=args.replace)
    print(f"schedule entry {args.name} {outcome}")
    return 0
