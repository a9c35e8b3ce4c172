"""What the admin page's charts show: jobs finished, failures, run times and the backlog over a
time range, per queue and task, read from the per-minute statistics of migration 0006.

The sweeper rolls each closed minute up (``stats_rollup``); the minutes since, normally the last
one or two, are read from ``jobs`` itself, so a chart is live to the second. When no sweeper has
run for a while (no worker, no ``pgbroker sweep``), the page rolls the missing minutes up itself
before reading. Run times and waits are kept as histograms of two buckets per doubling, so a
percentile is exact to within a factor of 1.41 (it is drawn at the bucket's geometric middle,
interpolated by rank).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from .._pg.catalogue import Queries

__all__ = ["RANGES", "Charts", "Histogram", "Point", "TaskRow", "Window", "read", "window"]

#: The ranges offered, in seconds.
RANGES = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
#: Step sizes (seconds): the smallest that keeps a chart to at most MAX_STEPS bars.
STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
MAX_STEPS = 90
#: How far behind the rollup may be before the page rolls up itself (no sweeper running).
STALE = timedelta(minutes=3)
ORIGIN = datetime(2000, 1, 3, tzinfo=timezone.utc)  # a Monday at 00:00 UTC: steps align to it


class Histogram:
    """Counts per bucket (``stats_bucket`` in migration 0006) of durations in milliseconds."""

    def __init__(self, counts: Mapping[Any, Any] | None = None):
        self.counts: dict[int, int] = {}
        if counts:
            self.add(counts)

    def add(self, counts: Mapping[Any, Any]) -> None:
        for bucket, n in counts.items():
            self.counts[int(bucket)] = self.counts.get(int(bucket), 0) + int(n)

    def merge(self, other: Histogram) -> None:
        self.add(other.counts)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @staticmethod
    def bounds(bucket: int) -> tuple[float, float]:
        """The bucket's range in milliseconds."""
        if bucket <= 0:
            return 0.0, 1.0
        return 2 ** ((bucket - 1) / 2), 2 ** (bucket / 2)

    def percentile(self, p: float) -> float | None:
        """The ``p``-th percentile (0-100) in milliseconds, None when empty."""
        total = self.total
        if not total:
            return None
        rank = p / 100 * total
        seen = 0
        for bucket in sorted(self.counts):
            n = self.counts[bucket]
            if seen + n >= rank:
                low, high = self.bounds(bucket)
                share = (rank - seen) / n if n else 0.0
                if bucket <= 0:
                    return low + (high - low) * share
                value: float = low * (high / low) ** share
                return value
            seen += n
        return self.bounds(max(self.counts))[1]


@dataclass(frozen=True)
class Window:
    """The time range a chart covers, and its step."""

    since: datetime
    until: datetime
    step: int               #: seconds per bar
    live: bool              #: ends now (refreshed)
    key: str | None         #: one of RANGES, or None for a custom range

    def starts(self) -> list[datetime]:
        """The start of every step, oldest first."""
        first = _floor(self.since, self.step)
        n = math.ceil((self.until - first).total_seconds() / self.step)
        return [first + timedelta(seconds=self.step * i) for i in range(max(n, 1))]


def _floor(t: datetime, step: int) -> datetime:
    return ORIGIN + timedelta(seconds=(t - ORIGIN).total_seconds() // step * step)


def window(now: datetime, key: str | None = "1h", since: datetime | None = None,
           until: datetime | None = None) -> Window:
    """The window of a named range ending now, or of a custom one (``since``/``until``)."""
    if since is not None or until is not None:
        until = min(until or now, now)
        since = since or until - timedelta(hours=1)
        if since >= until:
            raise ValueError("the range is empty: 'from' must be before 'to'")
        since = max(since, now - timedelta(days=7))  # what the statistics keep
        key, live = None, until >= now - timedelta(seconds=1)
    else:
        if key not in RANGES:
            key = "1h"
        until, since, live = now, now - timedelta(seconds=RANGES[key]), True
    span = (until - since).total_seconds()
    step = next((s for s in STEPS if span / s <= MAX_STEPS), STEPS[-1])
    return Window(since, until, step, live, key)


@dataclass
class Point:
    """One step of one chart: what finished in it, and the backlog sampled in it."""

    at: datetime
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    run: Histogram = field(default_factory=Histogram)
    wait: Histogram = field(default_factory=Histogram)
    pending: int | None = None
    scheduled: int | None = None
    running: int | None = None
    oldest: float | None = None

    @property
    def finished(self) -> int:
        return self.succeeded + self.retried + self.failed + self.cancelled + self.expired

    def add(self, counts: Iterable[Any], run: Mapping[Any, Any], wait: Mapping[Any, Any]
            ) -> None:
        s, r, f, c, e = (int(n) for n in counts)
        self.succeeded += s
        self.retried += r
        self.failed += f
        self.cancelled += c
        self.expired += e
        self.run.add(run)
        self.wait.add(wait)


@dataclass
class TaskRow(Point):
    """A (queue, task) over the whole window."""

    queue: str = ""
    task: str = ""


@dataclass(frozen=True)
class Charts:
    window: Window
    points: list[Point]
    tasks: list[TaskRow]        #: busiest first
    rolled_up_to: datetime | None
    total: Point                #: the whole window

    @property
    def empty(self) -> bool:
        return not self.total.finished and all(p.pending is None for p in self.points)


def read(conn: psycopg.Connection[Any], q: Queries, win: Window,
         queue: str | None = None, task: str | None = None) -> Charts:
    """Everything the charts of ``win`` show, for one queue/task or all."""
    def run(name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return q.all(conn, name, params)

    (upto, now), = run("stats_upto", {})
    if upto is None or upto < now - STALE:
        # No sweeper lately: roll the missing minutes up here, a day at most per page load.
        run("stats_rollup", {"lag": 10.0, "minutes": 1440, "backfill": 86400.0})
        (upto, now), = run("stats_upto", {})
    by_step = {t: Point(t) for t in win.starts()}
    tasks: dict[tuple[str, str], TaskRow] = {}
    total = Point(win.since)
    filters = {"queue": queue, "task": task}

    def take(t: datetime, q_: str, t_: str, counts: Iterable[Any], run_ms: Any, wait_ms: Any
             ) -> None:
        counts = list(counts)
        for target in (by_step.setdefault(t, Point(t)),
                       tasks.setdefault((q_, t_), TaskRow(win.since, queue=q_, task=t_)), total):
            target.add(counts, run_ms, wait_ms)

    rolled_until = min(win.until, upto) if upto is not None else win.since
    if rolled_until > win.since:
        for t, q_, t_, *rest in run("stats_finished_read", {
                **filters, "since": win.since, "until": rolled_until, "step": win.step,
                "origin": ORIGIN}):
            take(t, q_, t_, rest[:5], rest[5], rest[6])
    if win.until > rolled_until:
        for minute, q_, t_, *rest in run("stats_finished_live", {
                **filters, "since": max(rolled_until, win.since), "until": win.until}):
            take(_floor(minute, win.step), q_, t_, rest[:5], rest[5], rest[6])
    for t, pending, scheduled, running, oldest in run("stats_depth_read", {
            **filters, "since": win.since, "until": win.until, "step": win.step,
            "origin": ORIGIN}):
        p = by_step.setdefault(t, Point(t))
        p.pending, p.scheduled, p.running, p.oldest = pending, scheduled, running, oldest
    points = [by_step[t] for t in sorted(by_step)]
    ranked = sorted(tasks.values(), key=lambda r: (-r.finished, r.queue, r.task))
    return Charts(win, points, ranked, upto, total)
