"""pgbroker.beat against a real PostgreSQL, with an injected clock (no sleeping, no processes).

Every test drives :meth:`Scheduler.run_once` at chosen instants and reads the rows it wrote
(``beat_schedule``, ``jobs``, the ``beat_status`` view). Jobs are made to look running, finished
or retried by updating their rows, as a worker would have left them. The real ``celery beat``
processes are in ``tests/e2e/test_beat_processes.py``.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from celery import Celery
from celery.schedules import crontab, solar
from psycopg.rows import dict_row

from pgbroker._model.schedule import occurrence_key
from pgbroker.beat import Fired, Scheduler
from pgbroker.schedules import Schedules
from pgbroker.errors import ConfigurationError
from tests.support import db as support_db
from tests.support.processes import Run

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")
T0 = datetime(2025, 1, 6, 12, 0, 30, tzinfo=UTC)  # a Monday
MIN = timedelta(minutes=1)


class Clock:
    """The schedulers' injected clock: tests move it by hand."""

    def __init__(self, t: datetime):
        self.t = t

    def __call__(self) -> datetime:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def app(broker_url: str) -> Celery:
    app = Celery("beat-tests", broker=broker_url, set_as_current=False)
    app.conf.result_expires = None  # no celery.backend_cleanup default entry in these tests
    return app


Start = Callable[..., Scheduler]


@pytest.fixture
def start(app: Celery, clock: Clock) -> Iterator[Start]:
    """``start({name: entry})`` -> a started Scheduler (a beat process's), closed at the end."""
    made: list[Scheduler] = []

    def run(schedule: dict[str, Any], the_app: Celery | None = None) -> Scheduler:
        the_app = the_app or app
        the_app.conf.beat_schedule = schedule
        made.append(Scheduler(the_app, now=clock))
        return made[-1]

    yield run
    for scheduler in made:
        scheduler.close()


def entry(pg: psycopg.Connection, name: str) -> dict[str, Any]:
    row = pg.cursor(row_factory=dict_row).execute(
        "SELECT * FROM pgbroker.beat_schedule WHERE name = %s", (name,)).fetchone()
    assert row is not None, f"no entry {name}"
    return row


def jobs(pg: psycopg.Connection, task: str | None = None) -> list[dict[str, Any]]:
    return support_db.jobs(pg, "task = coalesce(%s, task)", (task,), order="idempotency_key")


def set_job_state(pg: psycopg.Connection, job_id: Any, state: str,
                  updated_at: datetime | None = None) -> None:
    """Leave a job as a worker would: running (claimed), completed, dead..."""
    pg.execute("UPDATE pgbroker.jobs SET state = %s, attempts = 1,"
               " locked_by = CASE WHEN %s = 'running' THEN gen_random_uuid() END,"
               " updated_at = coalesce(%s, now()) WHERE id = %s",
               (state, state, updated_at, job_id))


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def occurrences(fired: list[Fired], name: str | None = None) -> list[datetime]:
    return [f.occurrence for f in fired if name is None or f.entry == name]


# -- firing: exactly once, on the grid, with what a task needs -----------------------------------

def test_an_occurrence_fires_once_with_its_key_and_headers(start: Start, pg: psycopg.Connection,
                                                           clock: Clock) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0, "args": (1, "two"),
                           "kwargs": {"when": T0}, "options": {"queue": "periodic",
                                                              "priority": 7,
                                                              "misfire": "skip"}}})
    assert entry(pg, "tick")["next_occurrence"] == at(2025, 1, 6, 12, 1)  # first after start
    assert beat.run_once(at(2025, 1, 6, 12, 0, 59)) == []
    fired = beat.run_once(at(2025, 1, 6, 12, 1, 0, ))
    assert occurrences(fired) == [at(2025, 1, 6, 12, 1)]
    assert beat.run_once(at(2025, 1, 6, 12, 1, 0, 500000)) == []  # the same instant, again

    [job] = jobs(pg)
    assert job["id"] == fired[0].job_id
    assert (job["queue"], job["task"], job["priority"]) == ("periodic", "app.tick", 7)
    assert job["idempotency_key"] == "beat:tick:2025-01-06T12:01:00+00:00" \
        == occurrence_key("tick", fired[0].occurrence) == fired[0].idempotency_key
    assert job["headers"]["pgbroker_occurrence"] == "2025-01-06T12:01:00+00:00"
    assert job["headers"]["pgbroker_beat_entry"] == "tick"
    assert job["headers"]["celery_beat_task"] is True
    assert "misfire" not in job["headers"]  # beat's own options are not sent
    args, kwargs, _embed = json.loads(bytes(job["body"]))
    assert args == [1, "two"] and kwargs["when"]["__value__"].startswith("2025-01-06T12:00:30")

    row = entry(pg, "tick")
    assert (row["last_occurrence"], row["next_occurrence"], row["total_runs"]) == \
        (at(2025, 1, 6, 12, 1), at(2025, 1, 6, 12, 2), 1)
    assert (row["last_job_id"], row["last_job_state"]) == (job["id"], "pending")
    assert row["last_task_id"] == job["task_id"]


def test_many_beats_racing_fire_each_occurrence_once(start: Start, pg: psycopg.Connection,
                                                     clock: Clock) -> None:
    """Four schedulers (four connections) run every pass at the same instants, in threads."""
    clock.t = at(2025, 1, 6, 12, 1, 0)
    schedule = {"tick": {"task": "app.tick", "schedule": 1.0, "options": {"overlap": "allow"}},
                "other": {"task": "app.other", "schedule": 2.0, "options": {"overlap": "allow"}}}
    beats = [start(schedule) for _ in range(4)]
    instants = [at(2025, 1, 6, 12, 1, s) for s in range(1, 31)]
    barrier = threading.Barrier(len(beats))
    by_beat: list[list[Fired]] = [[] for _ in beats]
    errors: list[BaseException] = []

    def run(beat: Scheduler, fired: list[Fired]) -> None:
        try:
            for t in instants:
                barrier.wait(timeout=30)
                fired.extend(beat.run_once(t))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=args) for args in zip(beats, by_beat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    fired = [f for part in by_beat for f in part]
    assert sorted(occurrences(fired, "tick")) == instants  # each second once, none missed
    assert sorted(occurrences(fired, "other")) == [t for t in instants if t.second % 2 == 0]
    keys = [j["idempotency_key"] for j in jobs(pg)]
    assert len(keys) == len(set(keys)) == 30 + 15
    print(f"\n4 racing beats: {len(fired)} occurrences fired ({[len(p) for p in by_beat]} by "
          f"each), {len(keys)} jobs, 0 duplicates")


def test_a_restarted_beat_continues_where_the_last_one_left_off(start: Start, clock: Clock,
                                                                pg: psycopg.Connection) -> None:
    schedule = {"tick": {"task": "app.tick", "schedule": 60.0, "options": {"overlap": "allow"}}}
    first = start(schedule)
    first.run_once(at(2025, 1, 6, 12, 1, 0))
    first.run_once(at(2025, 1, 6, 12, 2, 0))
    first.close()
    clock.t = at(2025, 1, 6, 12, 2, 30)  # the new beat starts half a period later
    second = start(schedule)
    assert second.sync_config() == {"added": [], "changed": [], "removed": []}
    row = entry(pg, "tick")
    assert (row["total_runs"], row["next_occurrence"]) == (2, at(2025, 1, 6, 12, 3))
    assert occurrences(second.run_once(at(2025, 1, 6, 12, 3, 0))) == [at(2025, 1, 6, 12, 3)]


# -- misfire and overlap -------------------------------------------------------------------------

def test_misfire_after_five_minutes_down_latest_fires_once_skip_waits(
        start: Start, pg: psycopg.Connection) -> None:
    beat = start({
        "latest": {"task": "app.a", "schedule": 60.0, "options": {"overlap": "allow"}},
        "skip": {"task": "app.b", "schedule": 60.0,
                 "options": {"overlap": "allow", "misfire": "skip"}}})
    assert len(beat.run_once(at(2025, 1, 6, 12, 1, 0))) == 2
    # beat is stopped for 5 minutes: 12:02 ... 12:06 are missed
    fired = beat.run_once(at(2025, 1, 6, 12, 6, 10))
    assert [(f.entry, f.occurrence) for f in fired] == [("latest", at(2025, 1, 6, 12, 6))]
    assert entry(pg, "skip")["next_occurrence"] == at(2025, 1, 6, 12, 7)
    assert entry(pg, "latest")["next_occurrence"] == at(2025, 1, 6, 12, 7)
    assert beat.run_once(at(2025, 1, 6, 12, 6, 50)) == []
    assert sorted(f.entry for f in beat.run_once(at(2025, 1, 6, 12, 7, 0))) == ["latest", "skip"]
    assert [(r["task"], r["idempotency_key"][-14:-6]) for r in jobs(pg)] == [
        ("app.a", "12:01:00"), ("app.a", "12:06:00"), ("app.a", "12:07:00"),
        ("app.b", "12:01:00"), ("app.b", "12:07:00")]


def test_overlap_skip_drops_queue_waits_allow_runs_alongside(start: Start,
                                                             pg: psycopg.Connection) -> None:
    beat = start({name: {"task": f"app.{name}", "schedule": 60.0, "options": {"overlap": name}}
                  for name in ("skip", "queue", "allow")})
    first = {f.entry: f for f in beat.run_once(at(2025, 1, 6, 12, 1, 0))}
    assert sorted(first) == ["allow", "queue", "skip"]
    for f in first.values():
        set_job_state(pg, f.job_id, "running")

    fired = beat.run_once(at(2025, 1, 6, 12, 2, 0))  # the previous runs are still running
    assert [f.entry for f in fired] == ["allow"]
    assert entry(pg, "skip")["next_occurrence"] == at(2025, 1, 6, 12, 3)   # dropped
    assert entry(pg, "queue")["next_occurrence"] == at(2025, 1, 6, 12, 2)  # waiting
    assert beat.run_once(at(2025, 1, 6, 12, 2, 30)) == []

    for name in ("skip", "queue"):
        set_job_state(pg, first[name].job_id, "completed")
    fired = beat.run_once(at(2025, 1, 6, 12, 2, 40))
    assert [(f.entry, f.occurrence) for f in fired] == [("queue", at(2025, 1, 6, 12, 2))]
    assert len(jobs(pg, "app.queue")) == 2 and len(jobs(pg, "app.skip")) == 1


def test_a_celery_retry_of_the_previous_job_counts_as_unfinished(start: Start,
                                                                 pg: psycopg.Connection) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0}})
    [first] = beat.run_once(at(2025, 1, 6, 12, 1, 0))
    # self.retry(): a new row, same task id, retries + 1; the first delivery was acked
    set_job_state(pg, first.job_id, "completed")
    pg.execute("INSERT INTO pgbroker.jobs (id, queue, task, task_id, retries, body, state, run_at)"
               " SELECT gen_random_uuid(), queue, task, task_id, 1, body, 'scheduled',"
               " now() + interval '1 hour' FROM pgbroker.jobs WHERE id = %s", (first.job_id,))
    assert beat.run_once(at(2025, 1, 6, 12, 2, 0)) == []  # overlap skip
    pg.execute("UPDATE pgbroker.jobs SET state = 'dead' WHERE retries = 1")
    assert occurrences(beat.run_once(at(2025, 1, 6, 12, 3, 0))) == [at(2025, 1, 6, 12, 3)]
    assert entry(pg, "tick")["last_completed_at"] is None  # a dead retry is no completion


# -- crontab and solar ---------------------------------------------------------------------------

def test_crontab_entries_fire_at_their_wall_clock_minutes(start: Start, app: Celery,
                                                          clock: Clock) -> None:
    """Three crontabs in Europe/Paris, over a weekend when clocks go forward; the clock moves
    in 5-minute steps from Saturday 06:00 UTC to Monday 10:00 UTC."""
    app.conf.timezone = "Europe/Paris"
    allow = {"overlap": "allow"}
    clock.t = at(2025, 3, 29, 6, 0)
    beat = start({
        "daily": {"task": "app.daily", "schedule": crontab(minute=30, hour=9), "options": allow},
        "quarter": {"task": "app.q", "schedule": crontab(minute="*/15"), "options": allow},
        "monday": {"task": "app.m", "schedule": crontab(minute=0, hour=8, day_of_week="mon"),
                   "options": allow}})
    fired: list[Fired] = []
    t = clock.t
    while t <= at(2025, 3, 31, 10, 0):
        fired += beat.run_once(t)
        t += 5 * MIN

    def local(name: str) -> list[str]:
        return [o.astimezone(PARIS).strftime("%a %d %H:%M") for o in occurrences(fired, name)]

    assert local("daily") == ["Sat 29 09:30", "Sun 30 09:30", "Mon 31 09:30"]
    assert occurrences(fired, "daily") == [at(2025, 3, 29, 8, 30), at(2025, 3, 30, 7, 30),
                                           at(2025, 3, 31, 7, 30)]  # UTC+1, then UTC+2
    assert local("monday") == ["Mon 31 08:00"]
    quarters = occurrences(fired, "quarter")
    assert all(o.minute % 15 == 0 and o.second == 0 for o in quarters)
    assert all(b - a == 15 * MIN for a, b in itertools.pairwise(quarters))  # none missed
    assert quarters[0] == at(2025, 3, 29, 6, 15) and quarters[-1] == at(2025, 3, 31, 10, 0)


def test_a_solar_entry_is_stored_and_fired(start: Start, pg: psycopg.Connection) -> None:
    pytest.importorskip("ephem")
    beat = start({"dawn": {"task": "app.dawn", "schedule": solar("sunrise", 48.85, 2.35)}})
    due = entry(pg, "dawn")["next_occurrence"]
    assert entry(pg, "dawn")["schedule"] == {"solar": {"event": "sunrise", "lat": 48.85,
                                                       "lon": 2.35}}
    assert occurrences(beat.run_once(due + timedelta(seconds=1))) == [due]


# -- configuration, at start and at run time -----------------------------------------------------

def test_config_changes_are_applied_at_restart_keeping_state(start: Start, clock: Clock,
                                                             pg: psycopg.Connection) -> None:
    allow = {"overlap": "allow"}
    first = start({"a": {"task": "app.a", "schedule": 60.0, "options": allow},
                   "b": {"task": "app.b", "schedule": 60.0, "options": allow}})
    first.run_once(at(2025, 1, 6, 12, 1, 0))
    Schedules(pg, actor="test", via="test").set_enabled("b", False)
    first.close()

    clock.t = at(2025, 1, 6, 12, 1, 20)
    start({"a": {"task": "app.a2", "schedule": crontab(minute="*/5"), "options": allow},
           "b": {"task": "app.b", "schedule": 60.0, "options": allow},
           "c": {"task": "app.c", "schedule": 60.0}})
    a = entry(pg, "a")
    assert (a["task"], a["total_runs"], a["last_occurrence"], a["next_occurrence"]) == \
        ("app.a2", 1, at(2025, 1, 6, 12, 1), at(2025, 1, 6, 12, 5))  # history kept, new grid
    assert entry(pg, "b")["enabled"] is False  # the operator's switch survives the restart
    assert entry(pg, "c")["next_occurrence"] == at(2025, 1, 6, 12, 2)

    clock.t = at(2025, 1, 6, 12, 1, 40)
    third = start({"b": {"task": "app.b", "schedule": 60.0, "options": allow}})
    assert third.sync_config() == {"added": [], "changed": [], "removed": []}
    assert entry(pg, "a")["removed_at"] is not None and entry(pg, "c")["removed_at"] is not None
    Schedules(pg, actor="test", via="test").set_enabled("b", True)
    assert [f.entry for f in third.run_once(at(2025, 1, 6, 12, 10, 0))] == ["b"]  # not a nor c

    start({"a": {"task": "app.a2", "schedule": crontab(minute="*/5"), "options": allow}})
    assert entry(pg, "a")["removed_at"] is None  # back in the config: fires again
    assert entry(pg, "b")["removed_at"] is not None


def test_entries_enabled_added_and_changed_at_run_time_need_no_restart(
        start: Start, pg: psycopg.Connection) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0, "options": {"overlap": "allow"}}})
    ops = Schedules(pg, actor="alice", via="test")
    assert ops.set_enabled("tick", False) is True
    assert ops.set_enabled("tick", False) is False
    assert beat.run_once(at(2025, 1, 6, 12, 3, 0)) == []
    assert ops.set_enabled("tick", True) is True
    # disabled across three occurrences; misfire latest: one run now
    assert occurrences(beat.run_once(at(2025, 1, 6, 12, 3, 5))) == [at(2025, 1, 6, 12, 3)]

    assert ops.add("adhoc", "app.adhoc", 30, ["x"], {}, {"overlap": "allow"}) == "added"
    due = entry(pg, "adhoc")["next_occurrence"]
    assert "adhoc" in [f.entry for f in beat.run_once(due)]  # (and tick, long overdue)
    assert ops.add("adhoc", "app.adhoc", crontab(minute=0), replace=True) == "changed"
    row = entry(pg, "adhoc")
    assert (row["total_runs"], row["source"], row["next_occurrence"].minute) == (1, "runtime", 0)
    assert beat.sync_config()["removed"] == []  # a run-time entry is not the config's to remove
    assert [r[0] for r in pg.execute("SELECT action FROM pgbroker.audit ORDER BY id")] == [
        "schedule.disable", "schedule.disable", "schedule.enable", "schedule.add",
        "schedule.change"]


@pytest.mark.parametrize("config, message", [
    ({"task": "app.t", "schedule": 60, "options": {"routing_key": "x"}},
     r"beat entry 'bad': option\(s\) \['routing_key'\] are not supported"),
    ({"task": "app.t", "schedule": 60, "options": {"misfire": "all"}},
     r"beat entry 'bad': misfire must be one of latest, skip, not 'all'"),
    ({"task": "app.t", "schedule": 60, "options": {"overlap": "never"}},
     r"overlap must be one of skip, queue, allow"),
    ({"task": "app.t", "schedule": 60, "options": {"priority": 1000}},
     r"priority must be an integer from 0 to 255"),
    ({"task": "app.t", "schedule": 60, "args": [object()]}, r"must be JSON-serialisable"),
    ({"task": "app.t", "schedule": 60, "kwargs": ["not", "a", "mapping"]},
     r"kwargs must be a mapping"),
    ({"task": "app.t", "schedule": 0}, r"at least 1 ms"),
    ({"task": "app.t", "schedule": "daily"}, r"cannot be stored in PostgreSQL"),
    ({"task": "app.t"}, r"cannot be stored in PostgreSQL"),
    ({"task": "app.t", "schedule": 60, "misfire": "skip"}, r"beat entry 'bad': .*misfire"),
])
def test_a_bad_entry_is_refused_at_start_with_its_name(start: Start, pg: psycopg.Connection,
                                                       config: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        start({"good": {"task": "app.g", "schedule": 60}, "bad": config})
    assert pg.execute("SELECT count(*) FROM pgbroker.beat_schedule").fetchone()[0] == 0


def test_a_timezone_without_a_name_is_refused(start: Start, app: Celery) -> None:
    app.conf.timezone = timezone(timedelta(hours=2))
    with pytest.raises(ConfigurationError, match="has no IANA name"):
        start({"c": {"task": "app.c", "schedule": crontab()}})


def test_an_entry_that_cannot_be_sent_is_dropped_and_the_others_fire(
        start: Start, pg: psycopg.Connection) -> None:
    beat = start({"bad": {"task": "app.bad", "schedule": 60.0},
                  "good": {"task": "app.good", "schedule": 60.0}})
    pg.execute("""UPDATE pgbroker.beat_schedule SET options = '{"priority": "high"}'"""
               " WHERE name = 'bad'")  # as a hand-written UPDATE could leave it
    assert [f.entry for f in beat.run_once(at(2025, 1, 6, 12, 1, 0))] == ["good"]
    bad = entry(pg, "bad")
    assert "priority must be an integer" in bad["last_error"]
    assert (bad["next_occurrence"], bad["total_runs"]) == (at(2025, 1, 6, 12, 2), 0)
    assert [j["task"] for j in jobs(pg)] == ["app.good"]


def test_a_lost_database_connection_never_stops_beat(start: Start, pg: psycopg.Connection,
                                                     clock: Clock) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0}})
    pg.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
               " WHERE application_name = 'pgbroker beat' AND datname = current_database()")
    clock.t = at(2025, 1, 6, 12, 1, 0)
    assert beat.tick() == beat.retry_interval  # logged, not raised
    assert jobs(pg) == []
    assert beat.tick() == beat.max_interval  # reconnected: fired, then sleeps
    assert len(jobs(pg)) == 1


def test_tick_sleeps_until_the_next_occurrence_at_most_max_interval(start: Start,
                                                                    clock: Clock) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0}})
    clock.t = at(2025, 1, 6, 12, 0, 58)
    assert beat.tick() == pytest.approx(2.0)
    clock.t = at(2025, 1, 6, 12, 1, 0)
    assert beat.tick() == beat.max_interval == 5.0  # fired; the next is 60 s away


# -- the heartbeat -------------------------------------------------------------------------------

def test_beat_status_gives_the_age_of_the_last_completed_run(start: Start,
                                                             pg: psycopg.Connection) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0, "options": {"overlap": "allow"}}})

    def status() -> dict[str, Any]:
        return pg.cursor(row_factory=dict_row).execute(
            "SELECT * FROM pgbroker.beat_status WHERE entry = 'tick'").fetchone()

    assert status()["last_completed_at"] is None and status()["age_seconds"] is None
    [first] = beat.run_once(at(2025, 1, 6, 12, 1, 0))
    done = datetime.now(UTC) - timedelta(seconds=90)
    set_job_state(pg, first.job_id, "completed", done)
    row = status()
    assert row["last_completed_at"] == done  # read live from the job
    assert 90 <= row["age_seconds"] < 90 + 600
    assert set(row) == {"entry", "task", "enabled", "last_occurrence", "next_occurrence",
                        "last_completed_at", "age_seconds"}

    [second] = beat.run_once(at(2025, 1, 6, 12, 2, 0))
    pg.execute("DELETE FROM pgbroker.jobs WHERE id = %s", (first.job_id,))  # pruned
    assert status()["last_completed_at"] == done  # recorded when the entry moved on
    pg.execute("DELETE FROM pgbroker.jobs WHERE id = %s", (second.job_id,))  # retention 0
    assert beat.refresh() == 1
    assert entry(pg, "tick")["last_job_state"] == "gone"
    assert status()["age_seconds"] < 600  # a job gone at its ack counts as completed now


# -- the command line ----------------------------------------------------------------------------

def audit(pg: psycopg.Connection) -> list[tuple[str, str, dict]]:
    return pg.execute("SELECT action, target, detail FROM pgbroker.audit ORDER BY id").fetchall()


def test_cli_schedule_list_enable_disable(cli: Run, start: Start, pg: psycopg.Connection) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0},
                  "nightly": {"task": "app.night", "schedule": crontab(minute=0, hour=3)}})
    [fired] = beat.run_once(at(2025, 1, 6, 12, 1, 0))
    set_job_state(pg, fired.job_id, "completed")

    code, out, _ = cli("schedule", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "TASK", "SCHEDULE", "STATE", "NEXT"]
    assert "crontab 0 3 * * * (UTC)" in out and "every 60s" in out
    tick = next(line for line in lines if line.startswith("tick"))
    assert "enabled" in tick and "completed" in tick  # the last job, read live

    code, out, _ = cli("schedule", "disable", "tick", "--schema", "pgbroker")
    assert (code, out.strip()) == (0, "schedule entry tick disabled")
    assert (cli("schedule", "disable", "tick")[1].strip()
            == "schedule entry tick was already disabled")
    assert beat.run_once(at(2025, 1, 6, 12, 5, 0)) == []  # picked up without a restart
    code, out, _ = cli("schedule", "list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["tick"]["enabled"] is False and rows["tick"]["total_runs"] == 1
    assert rows["tick"]["age_seconds"] is not None  # its run completed
    assert cli("schedule", "enable", "tick")[0] == 0
    assert len(beat.run_once(at(2025, 1, 6, 12, 5, 1))) == 1

    assert [(a, t, d["changed"]) for a, t, d in audit(pg)] == [
        ("schedule.disable", "schedule:tick", True), ("schedule.disable", "schedule:tick", False),
        ("schedule.enable", "schedule:tick", True)]
    assert all(d["via"] == "cli" for _, _, d in audit(pg))


def test_cli_schedule_add_change_delete(cli: Run, start: Start, pg: psycopg.Connection) -> None:
    beat = start({"tick": {"task": "app.tick", "schedule": 60.0}})
    code, out, err = cli("schedule", "add", "report", "app.report", "--crontab", "0 6 * * mon",
                         "--tz", "Europe/Paris", "--kwargs", '{"weeks": 1}', "--queue", "reports",
                         "--misfire", "skip", "--overlap", "queue")
    assert (code, out.strip(), err.splitlines()[1:]) == (0, "schedule entry report added", [])
    row = entry(pg, "report")
    assert (row["misfire"], row["overlap"], row["options"], row["kwargs"]) == \
        ("skip", "queue", {"queue": "reports"}, {"weeks": 1})
    assert row["next_occurrence"].astimezone(PARIS).strftime("%a %H:%M") == "Mon 06:00"
    assert "report" in [f.entry for f in beat.run_once(row["next_occurrence"])]
    assert jobs(pg, "app.report")[0]["queue"] == "reports"

    assert cli("schedule", "add", "report", "app.report", "--every", "3600")[0] == 2
    code, out, _ = cli("schedule", "add", "report", "app.report", "--every", "3600", "--replace")
    assert (code, out.strip()) == (0, "schedule entry report changed")
    assert entry(pg, "report")["total_runs"] == 1

    assert cli("schedule", "delete", "report")[0] == 0
    assert pg.execute("SELECT count(*) FROM pgbroker.beat_schedule WHERE name = 'report'"
                      ).fetchone()[0] == 0
    assert [a for a, _, _ in audit(pg)] == ["schedule.add", "schedule.change", "schedule.delete"]
    assert audit(pg)[-1][2]["total_runs"] == 1


@pytest.mark.parametrize("args, message", [
    (("enable", "nope"), "no schedule entry 'nope' (known: tick)"),
    (("delete", "nope"), "no schedule entry 'nope'"),
    (("delete", "tick"), "comes from the beat_schedule config"),
    (("add", "tick", "app.x", "--every", "5", "--replace"), "comes from the beat_schedule config"),
    (("add", "x", "app.x", "--crontab", "61 * * * *"), "invalid --crontab"),
    (("add", "x", "app.x", "--crontab", "* * *"), "--crontab needs 5 fields"),
    (("add", "x", "app.x", "--every", "5", "--args", "[1,"), "--args is not JSON"),
    (("add", "x", "app.x", "--every", "5", "--args", "{}"), "args must be a list"),
    (("add", "x", "app.x", "--every", "5", "--priority", "300"), "priority must be an integer"),
    (("add", "x", "app.x", "--crontab", "0 * * * *", "--tz", "Mars/Olympus"),
     "unknown time zone 'Mars/Olympus'"),
])
def test_cli_schedule_mistakes_exit_2_and_change_nothing(cli: Run, start: Start,
                                                         pg: psycopg.Connection,
                                                         args: tuple[str, ...],
                                                         message: str) -> None:
    start({"tick": {"task": "app.tick", "schedule": 60.0}})
    before = pg.execute("SELECT name, enabled, schedule, updated_at FROM pgbroker.beat_schedule"
                        " ORDER BY name").fetchall()
    code, out, err = cli("schedule", *args)
    assert code == 2, (out, err)
    assert message in err
    assert pg.execute("SELECT name, enabled, schedule, updated_at FROM pgbroker.beat_schedule"
                      " ORDER BY name").fetchall() == before
    assert audit(pg) == []


def test_cli_schedule_without_a_database_exits_1(cli: Run) -> None:
    code, _, err = cli("schedule", "list", "--database-url",
                       "postgresql://postgres@127.0.0.1:1/nowhere")
    assert code == 1 and "cannot connect" in err
