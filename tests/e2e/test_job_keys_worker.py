"""Job keys with real ``celery worker`` processes (issue 22): dedupe while queued, concurrency
keys across several workers, cluster-wide rate limits.

The tasks (``tests/apps/keys_app.py``) record each run's start and end in ``public.key_runs`` by
the database clock; overlaps and rates are read from there with SQL. Figures are printed, not
asserted: ``pytest -s tests/e2e/test_job_keys_worker.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.rows import dict_row

from tests.apps import keys_app
from tests.support.workers import SHORT_LEASE, start_worker
from tests.support.processes import wait_for
from tests.support.producers import drop_pools, point_producer

APP = "tests.apps.keys_app"


@pytest.fixture
def runs(pg: psycopg.Connection) -> psycopg.Connection:
    pg.execute(keys_app.RUNS_DDL)
    return pg


@pytest.fixture
def producer(broker_url: str, runs: psycopg.Connection) -> Iterator[Celery]:
    point_producer(keys_app.app, broker_url)
    try:
        yield keys_app.app
    finally:
        drop_pools(keys_app.app)


def key_runs(pg: psycopg.Connection, where: str = "true") -> list[dict[str, Any]]:
    return pg.cursor(row_factory=dict_row).execute(
        f"SELECT * FROM public.key_runs WHERE {where} ORDER BY n").fetchall()


def states(pg: psycopg.Connection, task: str) -> dict[str, int]:
    return dict(pg.execute("SELECT state, count(*) FROM pgbroker.jobs WHERE task = %s"
                           " GROUP BY state", (task,)).fetchall())


def max_overlap(pg: psycopg.Connection, where: str = "true") -> int:
    """The most runs (matching ``where``) that were running at one instant."""
    return pg.execute(f"""
        WITH r AS (SELECT * FROM public.key_runs WHERE {where} AND ended IS NOT NULL),
             edges AS (SELECT started AS at, 1 AS d FROM r UNION ALL
                       SELECT ended, -1 FROM r)
        SELECT coalesce(max(level), 0) FROM (
            SELECT sum(d) OVER (ORDER BY at, d) AS level FROM edges) AS l""").fetchone()[0]


# -- 1. dedupe while queued ------------------------------------------------------------------------

def test_dedupe_active_drops_requests_while_the_sync_runs(producer: Celery,
                                                          runs: psycopg.Connection,
                                                          broker_url: str) -> None:
    start_worker(broker_url, "-c", "2", app=APP)
    headers = {"dedupe_key": "sync:source-7", "dedupe_active": True}
    first = keys_app.sync.apply_async(("first", 2.0), headers=headers)
    wait_for(lambda: key_runs(runs), 30, message="the sync to start")
    for n in range(5):  # a sync already under way makes these pointless
        keys_app.sync.apply_async((f"again-{n}", 0.0), headers=headers)
    assert states(runs, "keys.sync") == {"running": 1}
    wait_for(lambda: states(runs, "keys.sync") == {"completed": 1}, 30,
             message=lambda: f"the sync to finish ({states(runs, 'keys.sync')})")
    keys_app.sync.apply_async(("after", 0.0), headers=headers)  # finished: accepted
    wait_for(lambda: states(runs, "keys.sync") == {"completed": 2}, 30,
             message=lambda: f"the new sync ({states(runs, 'keys.sync')})")
    assert [r["arg"] for r in key_runs(runs)] == ["first", "after"]
    assert first.id == runs.execute("SELECT task_id FROM pgbroker.jobs ORDER BY id LIMIT 1"
                                    ).fetchone()[0]


@pytest.mark.parametrize("active", [True, False], ids=["dedupe_active", "queued_only"])
def test_a_celery_retry_keeps_its_job_and_its_slot(producer: Celery, runs: psycopg.Connection,
                                                   broker_url: str, active: bool) -> None:
    """A retry is a new row with the same task id: it continues the job, so it is never dropped
    as a duplicate; it takes the key's slot (so a new request while it waits is a duplicate of
    it) unless another copy holds the slot already."""
    start_worker(broker_url, "-c", "2", app=APP)
    headers = {"dedupe_key": "pay:9", "dedupe_active": active}
    result = keys_app.flaky.apply_async(("r", 1, 0.5), headers=headers)
    # the first run fails and publishes its retry (countdown 1 s): wait for it to be queued
    wait_for(lambda: runs.execute(
        "SELECT count(*) FROM pgbroker.jobs WHERE task_id = %s AND retries = 1"
        " AND state = 'scheduled'", (result.id,)).fetchone()[0] == 1, 30,
        message="the retry to wait in the database")
    holder = runs.execute("SELECT id, retries FROM pgbroker.jobs WHERE dedupe_key = 'pay:9'"
                          " AND state = 'scheduled'").fetchall()
    assert [r[1] for r in holder] == [1]  # the retry holds the slot
    keys_app.flaky.apply_async(("dup", 0, 0.0), headers=headers)  # a duplicate of the retry
    wait_for(lambda: states(runs, "keys.flaky") == {"completed": 2}, 30,
             message=lambda: f"the retry to run ({states(runs, 'keys.flaky')})")
    assert [(r["arg"], r["retries"]) for r in key_runs(runs)] == [("r", 0), ("r", 1)]
    assert result.id in {r[0] for r in runs.execute("SELECT task_id FROM pgbroker.jobs")}


def test_a_retry_is_queued_without_the_slot_when_a_new_copy_holds_it(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    """Without dedupe_active a copy may be queued while the first runs; the first's retry then
    finds the slot taken: it is queued all the same (without the slot), never dropped."""
    start_worker(broker_url, "-c", "1", app=APP)
    headers = {"dedupe_key": "sync:3"}
    keys_app.flaky.apply_async(("first", 1, 1.5), headers=headers)
    wait_for(lambda: key_runs(runs), 30, message="the first run to start")
    keys_app.flaky.apply_async(("second", 0, 0.0), headers=headers)  # queued meanwhile
    wait_for(lambda: states(runs, "keys.flaky").get("completed") == 3, 40,
             message=lambda: f"three completed deliveries ({states(runs, 'keys.flaky')})")
    assert sorted((r["arg"], r["retries"]) for r in key_runs(runs)) == [
        ("first", 0), ("first", 1), ("second", 0)]


# -- 2. concurrency keys ---------------------------------------------------------------------------

def test_a_concurrency_key_runs_one_at_a_time_across_three_workers(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    """Three workers of three processes each: the copies of source:42 never overlap (a retry
    and an eta'd copy among them), source:7 runs two at a time, unkeyed jobs flow past."""
    for _ in range(3):
        start_worker(broker_url, "-c", "3", app=APP)
    one = {"concurrency_key": "source:42"}
    two = {"concurrency_key": "source:7", "concurrency_limit": 2}
    for n in range(8):
        keys_app.sync.apply_async((f"source:42/{n}", 0.3), headers=one)
    keys_app.flaky.apply_async(("source:42/retried", 1, 0.3), headers=one)
    keys_app.sync.apply_async(("source:42/eta", 0.3), headers=one, countdown=1)
    for n in range(8):
        keys_app.sync.apply_async((f"source:7/{n}", 0.5), headers=two)
    for n in range(30):
        keys_app.sync.apply_async((f"free/{n}", 0.2))
    wait_for(lambda: len(key_runs(runs, "ended IS NOT NULL")) == 48, 90, interval=0.2,
             message=lambda: f"48 runs ({len(key_runs(runs, 'ended IS NOT NULL'))} done)")
    assert max_overlap(runs, "arg LIKE 'source:42/%'") == 1
    assert max_overlap(runs, "arg LIKE 'source:7/%'") == 2
    assert max_overlap(runs, "arg LIKE 'free/%'") >= 3
    # the free jobs did not wait behind the keyed ones: all done before source:42's last run
    last_free = runs.execute("SELECT max(ended) FROM public.key_runs WHERE arg LIKE 'free/%'"
                             ).fetchone()[0]
    last_42 = runs.execute("SELECT max(ended) FROM public.key_runs"
                           " WHERE arg LIKE 'source:42/%'").fetchone()[0]
    assert last_free < last_42
    # the retry kept its key (a new row with the same task id)
    assert runs.execute("SELECT array_agg(DISTINCT concurrency_key) FROM pgbroker.jobs"
                        " WHERE task = 'keys.flaky'").fetchone()[0] == ["source:42"]
    # a run's end is written by the task, its ack (which gives the slot back) a moment later
    wait_for(lambda: not runs.execute("SELECT count(*) FROM pgbroker.jobs WHERE state IN"
                                      " ('scheduled', 'pending', 'running')").fetchone()[0], 30,
             interval=0.1, message="every job acked")
    assert set(r[0] for r in runs.execute("SELECT running FROM pgbroker.concurrency_keys")) == {0}
    spread = runs.execute("SELECT count(DISTINCT pid) FROM public.key_runs"
                          " WHERE arg LIKE 'source:42/%'").fetchone()[0]
    print(f"\n[figure] source:42 ran in {spread} pool processes, never two at once")


def test_a_killed_worker_frees_its_key_when_the_sweeper_rescues_its_job(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    options = SHORT_LEASE
    doomed = start_worker(broker_url, "-c", "2", options=options, app=APP)
    one = {"concurrency_key": "source:42"}
    keys_app.sync.apply_async(("source:42/long", 4.0), headers=one)
    wait_for(lambda: key_runs(runs), 30, message="the long run to start")
    keys_app.sync.apply_async(("source:42/next", 0.1), headers=one)
    survivor = start_worker(broker_url, "-c", "2", options=options, app=APP)
    doomed.kill_group()  # SIGKILL, main process and pool: its job stays 'running'
    killed_at = runs.execute("SELECT clock_timestamp()").fetchone()[0]
    wait_for(lambda: len(key_runs(runs, "ended IS NOT NULL")) == 2, 60, interval=0.2,
             message=lambda: f"both to run on the survivor ({key_runs(runs)})")
    done = key_runs(runs, "ended IS NOT NULL")
    # nothing of the key ran until the sweeper rescued the killed job, and then one at a time
    assert all(r["started"] > killed_at for r in done)
    assert max_overlap(runs, "arg LIKE 'source:42/%'") == 1
    assert sorted(r["arg"] for r in done) == ["source:42/long", "source:42/next"]
    assert survivor.is_alive()
    assert set(r[0] for r in runs.execute("SELECT running FROM pgbroker.concurrency_keys")) == {0}


def test_a_requeued_delivery_frees_its_key(producer: Celery, runs: psycopg.Connection,
                                           broker_url: str) -> None:
    """A pool process killed under its task (task_reject_on_worker_lost): Celery requeues the
    delivery, which frees the key; the job then runs, and the next copy after it."""
    start_worker(broker_url, "-c", "2", app=APP)
    one = {"concurrency_key": "source:42"}
    keys_app.die_once.apply_async(("source:42/dies",), headers=one)
    keys_app.sync.apply_async(("source:42/after", 0.1), headers=one)
    wait_for(lambda: len(key_runs(runs, "ended IS NOT NULL")) == 2, 60, interval=0.2,
             message=lambda: f"the requeued job and the next ({key_runs(runs)})")
    assert [r["arg"] for r in key_runs(runs, "ended IS NOT NULL")] == [
        "source:42/dies", "source:42/after"]
    assert set(r[0] for r in runs.execute("SELECT running FROM pgbroker.concurrency_keys")) == {0}


# -- 3. cluster-wide rate limits ---------------------------------------------------------------

def test_a_rate_limit_holds_across_three_workers(producer: Celery, runs: psycopg.Connection,
                                                 broker_url: str) -> None:
    """keys.plain at 5/s: three workers of two processes claim 40 of them together, at most 5
    in any second (claim times, database clock); the jobs beyond wait in the database; another
    task flows at full speed meanwhile."""
    options = {"rate_limits": {"keys.plain": "5/s"}}
    for _ in range(3):
        start_worker(broker_url, "-c", "2", options=options, app=APP)
    for n in range(40):
        keys_app.plain.apply_async((f"limited/{n}",))
    for n in range(40):
        keys_app.sync.apply_async((f"free/{n}", 0.0))
    wait_for(lambda: len(key_runs(runs, "ended IS NOT NULL")) == 80, 60, interval=0.2,
             message=lambda: f"80 runs ({len(key_runs(runs, 'ended IS NOT NULL'))} done)")
    busiest = runs.execute("""
        SELECT max((SELECT count(*) FROM pgbroker.jobs AS b
                    WHERE b.task = 'keys.plain' AND b.locked_at >= a.locked_at
                      AND b.locked_at < a.locked_at + interval '1 second'))
        FROM pgbroker.jobs AS a WHERE a.task = 'keys.plain'""").fetchone()[0]
    assert busiest <= 5
    first, last = runs.execute("SELECT min(started), max(started) FROM public.key_runs"
                               " WHERE arg LIKE 'limited/%'").fetchone()
    spread = (last - first).total_seconds()
    assert spread >= 40 / 5 - 1 - 0.5  # 40 starts at 5/s (the first 5 at once)
    free_last = runs.execute("SELECT max(ended) FROM public.key_runs WHERE arg LIKE 'free/%'"
                             ).fetchone()[0]
    assert free_last < last  # the unlimited task did not wait behind the limited one
    per_worker = runs.execute("SELECT count(DISTINCT pid) FROM public.key_runs"
                              " WHERE arg LIKE 'limited/%'").fetchone()[0]
    assert runs.execute("SELECT max(attempts) FROM pgbroker.jobs").fetchone() == (1,)
    print(f"\n[figure] 40 jobs at 5/s over 3 workers ({per_worker} pool processes): starts "
          f"spread over {spread:.1f} s, busiest 1 s window of claims: {busiest}")


def test_a_keyed_job_of_a_task_acked_on_receipt_is_named_in_a_warning(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    """Acked on receipt, a job is 'running' only until the worker receives it: its concurrency
    key no longer holds its copies back. The worker says so, once per task name; not for a task
    that acks late, nor for a job without keys."""
    worker = start_worker(broker_url, "-c", "2", app=APP)
    try:
        sent = [keys_app.early.apply_async((f"e{i}", 0.0), headers={"concurrency_key": "k"})
                for i in range(2)]
        sent += [keys_app.early.delay("no-key"),
                 keys_app.sync.apply_async(("late", 0.0), headers={"concurrency_key": "k"})]
        wait_for(lambda: len(key_runs(runs)) == len(sent), 30, message="the four runs")
        worker.wait_for_log("pgbroker: task keys.early is acked on receipt")
    finally:
        worker.stop()
    log = worker.log()
    assert log.count("is acked on receipt") == 1, log
    assert "carry concurrency_key:" in log
