"""Queue metrics: read-only aggregates of the ``jobs`` table, and their Prometheus exposition.

Per queue and task name: pending (due now), scheduled (future ``run_at``), running, dead (the
failures), poison (dead because the consumer was lost during every attempt), redelivered (pending
or running jobs delivered before), the age of the oldest pending job (database clock), and the
completed / retried / cancelled / expired jobs of the retention window (retried: a try whose
task sent a Celery retry, acked ``completed``, its task going on in a new job: not completed).
Per queue: paused, consumers alive, publishes ever dropped as duplicates (``publish_duplicates``).
Per enabled beat entry: the age of its last completed run (``pgbroker.beat``'s
``beat_status`` view). VACUUM's side (:mod:`pgbroker._pg.vacuum`): the oldest transactions,
snapshots, prepared transactions, replication slots and standbys holding back its horizon, and
the hot tables' live and dead row versions and last vacuum.

How a scrape stays cheap on a table of millions of rows (``metrics_*`` in ``sql/ops.sql``):

* The states that stay small in a healthy system (pending, scheduled, running, dead) are counted
  exactly, one query branch per state so that each reads only its partial index's rows: the cost
  is the backlog, not the table. A backlog of millions costs what it costs (and says so).
* Finished rows (completed, cancelled, expired) are most of the table, kept for the retention
  window. They are counted incrementally: the first scrape counts the window once (a range scan
  of ``jobs_finished_idx``), keeping per-minute counts in memory; every later scrape reads only the
  rows finished since the previous one (a range scan of the same index), and drops the minutes
  that left the window. A row is stamped with its transaction's start time, so it may commit a
  little after a scrape passed its stamp: the last ``lag`` seconds are therefore counted for the
  current scrape only and read again by the next one. The counts are those of the last ``window``
  seconds, to the minute. Limits, honestly: a finished row deleted or changed by hand after it was
  counted stays counted until the next full recount (every ``resync`` seconds); a finishing
  transaction longer than ``lag`` is missed until then; each process (each admin server, each
  ``pgbroker stats``) pays the first full count once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg

from ._pg import driver as _db
from ._pg.catalogue import Queries
from ._pg.vacuum import VacuumReport
from ._pg.vacuum import read as read_vacuum
from .settings import Settings

__all__ = ["MetricsReader", "QueueStats", "Snapshot", "TaskStats", "is_internal_queue",
           "prometheus_registry"]

logger = logging.getLogger(__name__)

#: States counted exactly (small) and incrementally (finished, within the window).
ACTIVE_STATES = ("pending", "scheduled", "running", "dead")
#: (retried: a completed try whose task sent a Celery retry, not counted as completed)
FINISHED_STATES = ("completed", "retried", "cancelled", "expired")

_COUNTS = ("pending", "scheduled", "running", "dead", "completed", "retried", "cancelled",
           "expired", "redelivered", "poison")


def is_internal_queue(name: str) -> bool:
    """Celery's own queues: remote control (``<worker>.celery.pidbox``,
    ``<id>.reply.celery.pidbox``) and events (``celeryev.<id>``). There is one per worker process:
    as metric labels they would churn."""
    return name.endswith(".pidbox") or name.startswith("celeryev.")


@dataclasses.dataclass
class TaskStats:
    """The numbers of one (queue, task name); ``task`` is None for plain kombu messages."""

    queue: str
    task: str | None
    pending: int = 0
    scheduled: int = 0
    running: int = 0
    dead: int = 0
    completed: int = 0
    retried: int = 0  #: completed tries whose task sent a Celery retry (its next try is a job)
    cancelled: int = 0
    expired: int = 0
    redelivered: int = 0
    poison: int = 0
    oldest_pending_age: float | None = None

    def add(self, other: TaskStats) -> None:
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        ages = [a for a in (self.oldest_pending_age, other.oldest_pending_age) if a is not None]
        self.oldest_pending_age = max(ages) if ages else None


@dataclasses.dataclass
class QueueStats(TaskStats):
    """The numbers of one queue (its tasks summed), whether it is paused, its live consumers."""

    paused: bool = False
    consumers: int = 0
    deduplicated: int = 0  #: publishes ever dropped as duplicates (the same message, or key)

    @property
    def busy(self) -> bool:
        """Anything to show: jobs (finished ones: within the window), consumers, a pause."""
        return bool(self.paused or self.consumers or any(getattr(self, n) for n in _COUNTS))


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything one scrape read."""

    at: datetime                       #: the database clock
    tasks: list[TaskStats]
    paused: dict[str, bool]            #: every queue of the queues table
    consumers: dict[str, int]          #: consumers alive per queue
    consumers_alive: int
    beat: dict[str, float | None]      #: seconds since each entry's last run (None: never)
    window: float                      #: seconds of finished jobs counted
    duration: float                    #: seconds the scrape took
    hidden: int = 0                    #: Celery-internal queues left out (is_internal_queue)
    duplicates: dict[str, int] = dataclasses.field(default_factory=dict)  #: per queue, ever
    #: paused task names: when, by whom, why, the jobs that caused it, how many jobs wait
    paused_tasks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: consumers whose acks fail on a living connection: (id, host, pid) -> seconds (0017)
    settle_failing: dict[tuple[str, str, int], float] = dataclasses.field(default_factory=dict)
    #: who holds back VACUUM's horizon, and the hot tables' dead row versions
    vacuum: VacuumReport = dataclasses.field(default_factory=lambda: VacuumReport([], []))

    def queues(self) -> list[QueueStats]:
        """Per-queue totals, for every queue that has jobs, is declared, has consumers or had
        duplicate publishes."""
        names = ({t.queue for t in self.tasks} | set(self.paused) | set(self.consumers)
                 | set(self.duplicates))
        by_name = {n: QueueStats(n, None, paused=self.paused.get(n, False),
                                 consumers=self.consumers.get(n, 0),
                                 deduplicated=self.duplicates.get(n, 0)) for n in names}
        for t in self.tasks:
            by_name[t.queue].add(t)
        return [by_name[n] for n in sorted(by_name)]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``pgbroker stats --json``)."""
        return {
            "at": self.at.isoformat(),
            "window_seconds": self.window,
            "queues": [_public(q) for q in self.queues()],
            "tasks": [_public(t) for t in self.tasks],
            "consumers_alive": self.consumers_alive,
            "internal_queues_hidden": self.hidden,
            "beat": [{"entry": k, "last_run_age_seconds": v} for k, v in self.beat.items()],
            "paused_tasks": [{"task": k, **v, "paused_at": v["paused_at"].isoformat(),
                              "job_ids": [str(j) for j in v["job_ids"]]}
                             for k, v in self.paused_tasks.items()],
            "vacuum": self.vacuum.as_dict(),
        }


def _public(stats: TaskStats) -> dict[str, Any]:
    data = dataclasses.asdict(stats)
    if isinstance(stats, QueueStats):
        data.pop("task")
    return data


class _FinishedWindow:
    """Per-minute counts of finished jobs over the window, brought up to date incrementally."""

    def __init__(self, window: float, resync: float):
        self.window = window
        self.resync = resync
        self._minutes: dict[datetime, Counter[tuple[str, str | None, str]]] = {}
        self._total: Counter[tuple[str, str | None, str]] = Counter()  # sum of the minutes
        self._upto: datetime | None = None
        self._synced = 0.0
        self._lock = threading.Lock()

    def update(self, fetch: Callable[[datetime | None, datetime], list[tuple[Any, ...]]],
               now: datetime, upto: datetime) -> Counter[tuple[str, str | None, str]]:
        start = now - timedelta(seconds=self.window)
        with self._lock:
            if self._upto is None or time.monotonic() - self._synced > self.resync:
                self._minutes.clear()
                self._total.clear()
                self._upto = None
                self._synced = time.monotonic()
            since = max(self._upto, start) if self._upto is not None else start
            if upto > since:
                for minute, queue, task, state, n in fetch(since, upto):
                    self._minutes.setdefault(minute, Counter())[(queue, task, state)] += n
                    self._total[(queue, task, state)] += n
                self._upto = upto
            for minute in [m for m in self._minutes if m + timedelta(minutes=1) <= start]:
                self._total.subtract(self._minutes.pop(minute))
            # The last lag seconds are counted for this scrape only: read again next time, when
            # every row stamped in them has committed.
            recent: Counter[tuple[str, str | None, str]] = Counter()
            for _, queue, task, state, n in fetch(max(upto, start), now):
                recent[(queue, task, state)] += n
            return +(self._total + recent)  # without the keys that dropped to zero


class MetricsReader:
    """Reads :class:`Snapshot` s of one schema; keep one per process (it holds the finished
    counts between scrapes). Thread-safe."""

    def __init__(self, schema: str = "pgbroker", *, window: float | None = None,
                 lease_timeout: float | None = None, lag: float = 10.0,
                 resync: float = 3600.0, include_internal: bool = False):
        defaults = Settings(schema=schema)  # validates the name
        self.schema = schema
        self.include_internal = include_internal
        self.window = defaults.retention if window is None else float(window)
        self.lease_timeout = defaults.lease_timeout if lease_timeout is None else lease_timeout
        self.lag = lag
        self.q = Queries(schema)
        self._finished = _FinishedWindow(self.window, resync)
        self._beat_warned = False

    def _run(self, conn: psycopg.Connection[Any], name: str,
             params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return self.q.all(conn, name, params)

    def snapshot(self, conn: psycopg.Connection[Any]) -> Snapshot:
        """Read the metrics now over ``conn`` (autocommit), in one read-only transaction."""
        with _db.translate_errors("pgbroker metrics"), conn.transaction():
            self.q.execute(conn, "metrics_transaction", what="pgbroker metrics")
            self.q.execute(conn, "metrics_plan", what="pgbroker metrics")
            return self._read(conn)

    def _read(self, conn: psycopg.Connection[Any]) -> Snapshot:
        began = time.perf_counter()
        (now, upto), = self._run(conn, "metrics_clock", {"lag": self.lag})
        tasks: dict[tuple[str, str | None], TaskStats] = {}

        def stats(queue: str, task: str | None) -> TaskStats:
            return tasks.setdefault((queue, task), TaskStats(queue, task))

        for state, queue, task, n, redelivered, oldest, poison in self._run(
                conn, "metrics_active", {}):
            s = stats(queue, task)
            setattr(s, state, int(n))
            s.redelivered += int(redelivered)
            s.poison += int(poison)
            if oldest is not None:
                s.oldest_pending_age = max(float(oldest), 0.0)
        finished = self._finished.update(
            lambda since, until: self._run(conn, "metrics_finished",
                                           {"since": since, "upto": until}), now, upto)
        for (queue, task, state), n in finished.items():
            setattr(stats(queue, task), state, n)
        consumers: dict[str, int] = {}
        alive = 0
        for queue, n in self._run(conn, "metrics_consumers", {"lease": self.lease_timeout}):
            if queue is None:
                alive = int(n)  # the total row
            else:
                consumers[queue] = int(n)
        paused = {name: bool(p) for name, p in self._run(conn, "metrics_queues", {})}
        duplicates = {name: int(n) for name, n in self._run(conn, "metrics_duplicates", {})}
        shown: Callable[[str], bool] = (
            (lambda name: True) if self.include_internal
            else (lambda name: not is_internal_queue(name)))
        every = set(paused) | set(consumers) | set(duplicates) | {q for q, _ in tasks}
        return Snapshot(
            at=now,
            tasks=[tasks[k] for k in sorted(tasks, key=lambda k: (k[0], k[1] or ""))
                   if shown(k[0])],
            paused={q: p for q, p in paused.items() if shown(q)},
            consumers={q: n for q, n in consumers.items() if shown(q)},
            consumers_alive=alive,
            beat=self._beat(conn),
            window=self.window,
            duration=time.perf_counter() - began,
            hidden=sum(not shown(q) for q in every),
            duplicates={q: n for q, n in duplicates.items() if shown(q)},
            paused_tasks={r["task"]: {k: v for k, v in r.items() if k != "task"}
                          for r in self.q.dicts(conn, "task_pause_list", {})},
            vacuum=read_vacuum(conn, self.schema, now=now),
            settle_failing={(c, h, int(p)): float(s) for c, h, p, s
                            in self._run(conn, "metrics_settle_failures", {})},
        )

    def _beat(self, conn: psycopg.Connection[Any]) -> dict[str, float | None]:
        """Age of each enabled beat entry's last completed run (``beat_status``); empty when
        the view is not there, or not of the expected shape (warned once)."""
        (present,), = self._run(conn, "metrics_beat_present",
                                {"view": f'"{self.schema}".beat_status'})
        if not present:
            return {}
        try:
            with conn.transaction():  # a savepoint: the scrape's transaction survives an error
                return dict(self._run(conn, "metrics_beat", {}))
        except psycopg.errors.UndefinedColumn as exc:
            if not self._beat_warned:
                logger.warning("pgbroker metrics: no beat ages (%s)", str(exc).splitlines()[0])
                self._beat_warned = True
            return {}


def prometheus_registry(snapshot: Callable[[], Snapshot]) -> Any:
    """A ``prometheus_client`` registry whose one collector calls ``snapshot()`` on each scrape.

    A failed read is exposed as ``pgbroker_up 0`` (and logged), not as an HTTP error, so an
    alert can tell "the broker's database is unreachable" from "the exporter is down".
    """
    from prometheus_client.core import CollectorRegistry  # optional: the admin extra

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    return registry


class _Collector:
    def __init__(self, snapshot: Callable[[], Snapshot]):
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        return []  # nothing is read at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # optional

        try:
            snap = self._snapshot()
        except Exception as exc:  # noqa: BLE001 - exposed as pgbroker_up 0
            logger.warning("pgbroker metrics: scrape failed: %s", exc)
            yield GaugeMetricFamily("pgbroker_up", "1 if pgbroker's database could be read", 0)
            return
        yield GaugeMetricFamily("pgbroker_up", "1 if pgbroker's database could be read", 1)
        yield GaugeMetricFamily("pgbroker_scrape_duration_seconds",
                                "Seconds the metrics queries took", snap.duration)
        jobs = GaugeMetricFamily(
            "pgbroker_jobs", "Jobs per queue, task and state (completed, retried, cancelled and "
            "expired: those finished within the window; retried: a try that sent a Celery retry)",
            labels=["queue", "task", "state"])
        redelivered = GaugeMetricFamily(
            "pgbroker_jobs_redelivered", "Pending or running jobs that were delivered before",
            labels=["queue", "task"])
        poison = GaugeMetricFamily(
            "pgbroker_jobs_poison", "Dead jobs whose consumer was lost during every attempt",
            labels=["queue", "task"])
        oldest = GaugeMetricFamily(
            "pgbroker_oldest_pending_age_seconds",
            "Seconds the oldest due job has waited (database clock)", labels=["queue", "task"])
        for t in snap.tasks:
            labels = [t.queue, t.task or ""]
            for state in ACTIVE_STATES + FINISHED_STATES:
                jobs.add_metric(labels + [state], getattr(t, state))
            redelivered.add_metric(labels, t.redelivered)
            poison.add_metric(labels, t.poison)
            if t.oldest_pending_age is not None:
                oldest.add_metric(labels, t.oldest_pending_age)
        yield from (jobs, redelivered, poison, oldest)
        yield GaugeMetricFamily("pgbroker_finished_window_seconds",
                                "Seconds of finished jobs counted in pgbroker_jobs", snap.window)
        paused = GaugeMetricFamily("pgbroker_queue_paused", "1 if the queue is paused",
                                   labels=["queue"])
        consumers = GaugeMetricFamily("pgbroker_queue_consumers",
                                      "Consumers alive that consume the queue", labels=["queue"])
        duplicates = CounterMetricFamily(
            "pgbroker_publish_duplicates", "Publishes dropped as duplicates of a job (a "
            "producer's retry of the same message, or the same idempotency key)",
            labels=["queue"])
        for q in snap.queues():
            paused.add_metric([q.queue], int(q.paused))
            consumers.add_metric([q.queue], q.consumers)
            duplicates.add_metric([q.queue], q.deduplicated)
        yield from (paused, consumers, duplicates)
        yield GaugeMetricFamily("pgbroker_consumers_alive",
                                "Consumers with a heartbeat within the lease", snap.consumers_alive)
        failing = GaugeMetricFamily(
            "pgbroker_consumer_settle_failing_seconds", "Seconds a consumer's acks (requeues, "
            "burials) have failed on a living connection (a full disk, a timeout): its jobs "
            "stay running under it until they are written", labels=["consumer", "host", "pid"])
        for (consumer, host, pid), seconds in snap.settle_failing.items():
            failing.add_metric([consumer, host, str(pid)], seconds)
        yield failing
        beat = GaugeMetricFamily("pgbroker_beat_last_run_age_seconds",
                                 "Seconds since each beat entry last ran", labels=["entry"])
        for entry, age in snap.beat.items():
            if age is not None:
                beat.add_metric([entry], age)
        yield beat
        tasks = GaugeMetricFamily(
            "pgbroker_task_paused", "1 if the task name is paused (no worker claims it): by "
            "pgbroker when its deliveries kept killing their pool process or took down different "
            "workers, or by an operator",
            labels=["task"])
        for task in sorted({t.task for t in snap.tasks if t.task} | set(snap.paused_tasks)):
            tasks.add_metric([task], int(task in snap.paused_tasks))
        yield tasks
        yield from _vacuum_metrics(snap.vacuum)


def _vacuum_metrics(report: VacuumReport) -> Iterator[Any]:
    """Who holds back VACUUM's horizon, and the hot tables' row versions and last vacuum."""
    from prometheus_client.core import GaugeMetricFamily  # optional: the admin extra

    oldest = report.oldest
    yield GaugeMetricFamily(
        "pgbroker_xmin_horizon_age_seconds", "Seconds the oldest transaction or snapshot that "
        "holds back VACUUM has been open (0: none seen)", report.age or 0.0)
    yield GaugeMetricFamily(
        "pgbroker_xmin_horizon_age_xids", "Transactions since the oldest xmin that holds back "
        "VACUUM (0: none)", oldest.xid_age if oldest else 0)
    holders = GaugeMetricFamily(
        "pgbroker_xmin_horizon_holder_age_xids", "Transactions since the xmin each of the "
        "oldest holders of VACUUM's horizon holds (a session, a prepared transaction, a "
        "replication slot, a standby)", labels=["kind", "pid", "application_name", "state"])
    for h in report.holders:
        holders.add_metric([h.kind, "" if h.pid is None else str(h.pid), h.name or "",
                            h.state or ""], h.xid_age)
    yield holders
    families = {
        "live": GaugeMetricFamily("pgbroker_table_live_tuples", "Live row versions of each of "
                                  "pgbroker's hot tables (estimate)", labels=["table"]),
        "dead": GaugeMetricFamily("pgbroker_table_dead_tuples", "Dead row versions of each of "
                                  "pgbroker's hot tables, not vacuumed yet", labels=["table"]),
        "vacuumed_at": GaugeMetricFamily(
            "pgbroker_table_last_vacuum_timestamp_seconds", "When each hot table was last "
            "vacuumed, by hand or by autovacuum (Unix time)", labels=["table"]),
        "autovacuum": GaugeMetricFamily("pgbroker_table_autovacuum", "1 if autovacuum looks "
                                        "after the table", labels=["table"]),
    }
    for t in report.tables:
        for name, family in families.items():
            value = getattr(t, name)
            if isinstance(value, datetime):
                value = value.timestamp()
            if value is not None:
                family.add_metric([t.table], float(value))
    yield from families.values()
