"""When a beat entry fires: the grid of its occurrences and the misfire/overlap plan.

Pure arithmetic over aware UTC datetimes (no database, no clock): :class:`Grid` and its kinds
(:class:`Every` on multiples of an interval counted from the Unix epoch, :class:`Cron` at
wall-clock minutes in a time zone, :class:`Solar` at a solar event), :func:`grid_of` from a
``beat_schedule`` value, :func:`grid_from_spec` from the JSON stored in ``beat_schedule.schedule``,
and :func:`plan`, which applies an entry's ``misfire`` and ``overlap`` policies to a due occurrence
(see :mod:`pgbroker.beat` for what they mean). The scheduler, the operator's actions and the
health checks all read schedules through here, and the unit tests (``tests/unit``) test it alone.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery import schedules as celery_schedules

from ..errors import ConfigurationError

__all__ = [
    "EPOCH",
    "MISFIRE_POLICIES",
    "OVERLAP_POLICIES",
    "Cron",
    "Every",
    "Grid",
    "Plan",
    "Solar",
    "grid_from_spec",
    "grid_of",
    "iso_utc",
    "occurrence_key",
    "plan",
    "zone_name",
]

MISFIRE_POLICIES = ("latest", "skip")
OVERLAP_POLICIES = ("skip", "queue", "allow")

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


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
            self.cron = celery_schedules.crontab(**values, nowfun=self._now)
        except (ValueError, TypeError, celery_schedules.ParseException) as exc:
            raise ConfigurationError(f"invalid crontab {' '.join(values.values())!r}: {exc}") \
                from exc
        self.cron.tz = self.zone  # Celery's crontab reads the app's zone otherwise
        self.spec = {"crontab": values, "tz": tz}

    _probe = threading.local()

    def _now(self) -> datetime:
        """The time :meth:`next_after` asks about, else now: Celery before 5.7 compares the
        date of ``now`` with the last run's and would look from today instead."""
        return getattr(self._probe, "t", None) or datetime.now(self.zone)

    def next_after(self, t: datetime) -> datetime:
        probe = t
        for _ in range(4):
            self._probe.t = probe.astimezone(self.zone)
            try:
                last, delta, _now = self.cron.remaining_delta(self._probe.t, tz=self.zone)
            finally:
                self._probe.t = None
            found: datetime = (last + delta).astimezone(timezone.utc)
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
        event: datetime = self._next_event(self.solar.ephem.Date(start)).datetime()
        return event.replace(tzinfo=timezone.utc, microsecond=0)

    #: Days searched for an event that some days lack (sunrise in the polar night), as Celery.
    MAX_SEARCH_DAYS = 366

    def _next_event(self, start: Any) -> Any:
        """Celery 5.7's ``solar._next_event`` (5.4-5.6 have none): the first event after
        ``start``, looking on from the next anti-transit on a day without one; where none comes
        within MAX_SEARCH_DAYS, the time the search stopped (checked again then)."""
        solar = self.solar
        sun = solar.ephem.Sun()
        kwargs = {"use_center": True} if solar.use_center else {}
        for _ in range(self.MAX_SEARCH_DAYS):
            try:
                return getattr(solar.cal, solar.method)(sun, start=start, **kwargs)
            except solar.ephem.CircumpolarError:
                start = solar.cal.next_antitransit(sun, start=start)
        return start

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


def zone_name(zone: Any) -> str:
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


# -- naming an occurrence ------------------------------------------------------------------------

def occurrence_key(entry: str, occurrence: datetime) -> str:
    """The idempotency key of one occurrence: ``beat:<entry>:<ISO 8601 UTC>``."""
    return f"beat:{entry}:{iso_utc(occurrence)}"


def iso_utc(t: datetime) -> str:
    """``t`` in ISO 8601, UTC (keys, headers, logs)."""
    return t.astimezone(timezone.utc).isoformat()
