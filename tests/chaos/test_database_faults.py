"""Chaos on the database side: PostgreSQL restarted or crashed mid-load, every backend of a
worker terminated, a transaction holding back the xmin horizon, a publish that times out.

Real ``celery worker``/``celery beat`` processes of ``tests.apps.e2e_app``; the counts (tasks sent,
completed, duplicated, lost) come from SQL and are printed (``pytest -s``); recovery times are
printed, never asserted. The scenarios that stop the server run on a server of their own
(:mod:`tests.support.throwaway`); the others use the test database of the shared one.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from collections.abc import Iterator
from datetime import datetime
from urllib.parse import quote

import kombu
import psutil
import psycopg
import pytest
from celery import Celery

from tests.chaos.load import CHAOS_TASKS, LoadProducer, tally, wait_all_completed
from tests.support.throwaway import ThrowawayServer
from tests.apps import e2e_app as e2e
from tests.apps.beat_app import TICK
from tests.support.workers import key_runs, start_worker, wait_state
from tests.support.producers import drop_pools, point_producer
from tests.support.db import db_now
from tests.support.processes import run_beat, wait_for

#: The application names of a consuming worker's two connections (pgbroker._pg.driver.connect): the
#: process's shared store (publishes, the lease) and the event loop's LISTEN one.
WORKER_CONNECTIONS = {"pgbroker", "pgbroker listen"}


@pytest.fixture
def own_broker(own_db: str) -> Iterator[str]:
    """The throwaway server's database as a broker URL, with ``public.runs`` and the e2e app's
    producer pointed at it."""
    with psycopg.connect(own_db, autocommit=True) as pg:
        pg.execute(e2e.RUNS_DDL)
    point_producer(e2e.app, "pgbroker+" + own_db)
    try:
        yield "pgbroker+" + own_db
    finally:
        drop_pools(e2e.app)


def _occurrences(pg: psycopg.Connection) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT headers->>'pgbroker_occurrence' FROM pgbroker.jobs WHERE task = %s ORDER BY 1",
        (TICK,))]


# -- PostgreSQL restarted mid-load -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restart_mid_load_loses_nothing(own_server: ThrowawayServer, own_db: str,
                                                 own_broker: str, mode: str) -> None:
    """``pg_ctl restart -m fast`` (clean) and ``-m immediate`` (a crash: no checkpoint, every
    session cut) while a producer publishes and a worker and a beat run: all of them reconnect
    by themselves, every task completes, and beat keeps firing each occurrence once."""
    worker = start_worker(own_broker, *CHAOS_TASKS, "-c", "4")
    beat = run_beat("tests.apps.beat_app", own_broker, env={
        "PGBROKER_TEST_BEAT_OPTIONS": json.dumps({"overlap": "allow", "queue": "beat"})})
    load = LoadProducer(f"restart-{mode}", 400, rate=50).start()
    with psycopg.connect(own_db, autocommit=True) as pg:
        wait_for(lambda: pg.execute("SELECT count(*) FROM public.runs").fetchone()[0] >= 100,
                 60, interval=0.1, message="100 tasks run before the restart")
        wait_for(lambda: _occurrences(pg), 60, interval=0.2, message="beat's first occurrence")
        before = db_now(pg)
    downtime = own_server.restart(mode)

    with psycopg.connect(own_db, autocommit=True) as pg:
        back = db_now(pg)
        load.join(120)
        result = wait_all_completed(pg, load.keys, 120)
        # the first task that ran after the server came back, by the database clock
        first_after = pg.execute("SELECT min(at) FROM public.runs WHERE at > %s",
                                 (back,)).fetchone()[0]
        wait_for(lambda: any(o > back.isoformat() for o in _occurrences(pg)), 60,
                 interval=0.2, message="a beat occurrence after the restart")
        occurrences = _occurrences(pg)
    beat.stop()

    assert result.rows == result.sent  # no copies: a republished task id is one row
    assert len(occurrences) == len(set(occurrences)), "beat fired an occurrence twice"
    assert worker.is_alive() and worker.log().count("Connected to pgbroker") >= 2
    publish_errors = len(load.errors)
    times = sorted(datetime.fromisoformat(o) for o in occurrences)
    gap = max((b - a).total_seconds() for a, b in itertools.pairwise(times))
    print("\n" + result.line(
        f"PostgreSQL restart -m {mode}",
        f"server down/up in {downtime:.2f}s, first task run "
        f"{(first_after - back).total_seconds():.2f}s after it was back "
        f"({(first_after - before).total_seconds():.2f}s after the last check before the "
        f"restart); {publish_errors} publish error(s) surfaced to the producer and were "
        f"sent again; beat (1 s entry): {len(occurrences)} occurrences, none twice, "
        f"longest gap {gap:.0f}s"))


# -- every backend of the worker terminated --------------------------------------------------------

def _backends(pg: psycopg.Connection, pid: int) -> dict[int, tuple[str, str]]:
    """pgbroker's backends (pid -> (application name, last query)) of the process ``pid``,
    matched by the client ports of its TCP connections."""
    port = pg.info.port
    ports = [c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
             if c.raddr and c.raddr.port == port]
    rows = pg.execute(
        "SELECT pid, application_name, query FROM pg_stat_activity"
        " WHERE datname = current_database() AND client_port = ANY(%s)"
        " AND application_name LIKE 'pgbroker%%'", (ports,)).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def _listening(backends: dict[int, tuple[str, str]]) -> bool:
    """Both connections are open and the LISTEN one has run its LISTEN (its first
    statement: the event loop's claims follow it on that connection)."""
    names = {name for name, _ in backends.values()}
    return names >= WORKER_CONNECTIONS and any(
        name == "pgbroker listen" and query and not query.startswith("SET TIME ZONE")
        for name, query in backends.values())


def test_terminated_backends_worker_reconnects_and_listens_again(
        producer: object, runs: psycopg.Connection, broker_url: str) -> None:
    """``pg_terminate_backend`` on every connection of a worker (LISTEN and claims; the shared
    store's: publishes, lease) and of
    the producer, while two tasks run: the worker reconnects by itself and is woken by NOTIFY
    again -- its poll fallback is 120 s, so a task that runs within a minute was woken by a
    notification, not found by the poll."""
    worker = start_worker(broker_url, "-c", "3", options={"poll_interval": 120})
    before = e2e.touch.delay("before")
    wait_state(runs, before.id, "completed")
    naps = [f"inflight-{i}" for i in range(2)]
    for key in naps:
        e2e.nap.apply_async((key, 3), task_id=key)
    wait_for(lambda: all(key_runs(runs, k) for k in naps), 30, message="both naps running")
    old = wait_for(lambda: _listening(b := _backends(runs, worker.pid)) and b, 30,
                   message="the worker's two connections")
    mine = _backends(runs, os.getpid())  # the producer's connection
    assert {name for name, _ in mine.values()} == {"pgbroker"}

    killed_at = db_now(runs)
    runs.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                 (list(old) + list(mine),))
    wait_for(lambda: _listening(b := _backends(runs, worker.pid)) and not set(b) & set(old),
             60, interval=0.1, message="the worker to reconnect and LISTEN again (new backends)")
    back_at = db_now(runs)

    after = e2e.touch.delay("after")  # the producer reconnects through Celery's publish retry
    row = wait_state(runs, after.id, "completed", timeout=60)
    woken = (key_runs(runs, "after")[0]["at"] - row["created_at"]).total_seconds()
    for key in naps:
        wait_state(runs, key, "completed")
    result = tally(runs, naps, task="tests.apps.e2e_app.nap")
    assert result.lost == 0 and result.completed == 2
    assert worker.is_alive()
    assert "Connection to broker lost" in worker.log()  # noticed, not silently stuck
    print("\n" + result.line(
        "backends terminated (2 tasks in flight)",
        f"worker connected and listening again {(back_at - killed_at).total_seconds():.2f}s "
        f"after the kill; a task published then ran {woken * 1000:.0f} ms later (poll "
        "fallback: 120 s)"))


# -- a publish that times out ----------------------------------------------------------------------

@pytest.mark.parametrize("setting", ["statement_timeout", "lock_timeout"])
def test_publish_timeout_raises_a_clear_error_and_writes_nothing(
        db_url: str, pg: psycopg.Connection, setting: str) -> None:
    """Another client holds a lock on ``jobs`` that blocks INSERTs (a long migration, a manual
    ``LOCK``); the producer's URL sets a timeout (``?options=-c statement_timeout=500``): the
    publish fails with an error that says so, no row and no notification is left behind, and
    the next publish after the lock is gone works."""
    url = f"pgbroker+{db_url}?options={quote(f'-c {setting}=500')}"
    app = Celery("timeouts", broker=url, set_as_current=False)
    listener = psycopg.connect(db_url, autocommit=True)
    listener.execute('LISTEN "pgbroker.jobs"')
    holder = psycopg.connect(db_url)  # a transaction, left open
    try:
        holder.execute("LOCK TABLE pgbroker.jobs IN SHARE ROW EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(kombu.exceptions.OperationalError,
                           match=setting.replace("_", " ")) as info:
            app.send_task("tests.apps.e2e_app.touch", ("timed-out",), task_id="timed-out")
        failed_after = time.monotonic() - started
        with pytest.raises(kombu.exceptions.OperationalError, match=setting.replace("_", " ")):
            app.send_task("tests.apps.e2e_app.touch", ("no-retry",), task_id="no-retry",
                          retry=False)
        holder.rollback()
        assert pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone() == (0,)
        assert list(listener.notifies(timeout=0.5)) == []  # no wake-up for a row that isn't

        app.send_task("tests.apps.e2e_app.touch", ("after",), task_id="after")
        assert [r[0] for r in pg.execute("SELECT task_id FROM pgbroker.jobs")] == ["after"]
        [note] = listener.notifies(timeout=2, stop_after=1)
        assert note.payload.endswith(" celery")  # "<seconds until due> <queue>"
    finally:
        holder.close()
        listener.close()
        app.close()
    print(f"\n[figure] publish blocked by a lock, {setting}=500ms: {type(info.value).__name__}"
          f" ({info.value}) after {failed_after:.2f}s (Celery's publish retry included); "
          "0 rows, 0 notifications written")


# -- a transaction holding the xmin horizon back ---------------------------------------------------

def _window(pg: psycopg.Connection, keys: list[str], start: datetime,
            end: datetime) -> tuple[float, float, float]:
    """(tasks started per second, p50 and p99 publish->start latency in ms) in [start, end)."""
    lags = [r[0] for r in pg.execute(
        "SELECT extract(epoch FROM r.at - j.created_at)::float8 FROM public.runs AS r"
        " JOIN pgbroker.jobs AS j ON j.task_id = r.key"
        " WHERE r.key = ANY(%s) AND r.at >= %s AND r.at < %s", (keys, start, end))]
    if len(lags) < 2:
        return len(lags) / (end - start).total_seconds(), float("nan"), float("nan")
    cuts = statistics.quantiles(lags, n=100, method="inclusive")
    return len(lags) / (end - start).total_seconds(), cuts[49] * 1000, cuts[98] * 1000


def _dead_tuples(pg: psycopg.Connection) -> int:
    return pg.execute("SELECT n_dead_tup FROM pg_stat_user_tables"
                      " WHERE schemaname = 'pgbroker' AND relname = 'jobs_live'").fetchone()[0]


@pytest.mark.parametrize("hold", [6, pytest.param(60, marks=pytest.mark.slow)],
                         ids=lambda s: f"{s}s")
def test_held_xmin_degrades_throughput_but_the_queue_keeps_moving(
        producer: object, runs: psycopg.Connection, broker_url: str, db_url: str,
        hold: int) -> None:
    """A REPEATABLE READ transaction left open by another client pins the xmin horizon: no
    dead row version of ``jobs`` (every claim and ack leaves one) can be vacuumed while it
    lives. The queue must keep moving; the figures say by how much it slows down."""
    start_worker(broker_url, *CHAOS_TASKS, "-c", "4")
    phase = 4  # seconds of load before and after the hold
    load = LoadProducer("xmin", int(100 * (2 * phase + hold)), rate=100).start()
    time.sleep(phase)  # the scenario: load before the hold
    holder = psycopg.connect(db_url)
    try:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        held_from = holder.execute("SELECT clock_timestamp()").fetchone()[0]
        holder.execute("SELECT count(*) FROM pgbroker.jobs")  # takes the snapshot
        assert runs.execute("SELECT backend_xmin IS NOT NULL FROM pg_stat_activity"
                            " WHERE pid = %s", (holder.info.backend_pid,)).fetchone()[0]
        time.sleep(hold)  # the scenario: the snapshot held this long
        held_to = db_now(runs)
        dead_during = _dead_tuples(runs)
    finally:
        holder.close()
    load.join(2 * phase + 60)
    result = wait_all_completed(runs, load.keys, 120)
    keys = load.keys
    before = _window(runs, keys, held_from - (held_to - held_from) / hold * phase, held_from)
    during = _window(runs, keys, held_from, held_to)
    after = _window(runs, keys, held_to, held_to + (held_to - held_from) / hold * phase)

    assert result.lost == 0 and result.duplicated == 0 and result.rows == result.sent
    assert during[0] > 0, "nothing ran while the transaction was open"
    print("\n" + result.line(
        f"xmin held {hold}s (producer at 100/s, one worker -c 4)",
        f"tasks/s and p50/p99 publish->start latency: before {before[0]:.0f}/s "
        f"{before[1]:.0f}/{before[2]:.0f} ms, during {during[0]:.0f}/s "
        f"{during[1]:.0f}/{during[2]:.0f} ms, after {after[0]:.0f}/s "
        f"{after[1]:.0f}/{after[2]:.0f} ms; ~{dead_during} dead row versions in jobs at the "
        "end of the hold"))
