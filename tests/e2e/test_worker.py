"""End to end: real ``celery worker`` processes consuming ``tests.apps.e2e_app`` through pgbroker.

Every task records its runs in ``public.runs`` (see ``tests/apps/e2e_app.py``); the assertions count
those rows and read the ``jobs`` rows, never the worker's log alone. Figures (throughput, latency)
are printed, not asserted: run ``pytest -s tests/e2e`` to see them.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.support.workers import job, jobs_by_state, key_runs, percentile, start_worker, wait_state
from tests.support.processes import wait_for


def test_thousand_tasks_each_run_exactly_once(producer: Celery, runs: psycopg.Connection,
                                              broker_url: str) -> None:
    keys = [f"k{i}" for i in range(1000)]
    for key in keys:
        e2e.touch.delay(key)
    assert jobs_by_state(runs) == {"pending": 1000}

    worker = start_worker(broker_url, "-c", "2", "--prefetch-multiplier", "1")
    wait_for(lambda: jobs_by_state(runs) == {"completed": 1000}, 180, interval=0.2,
             message=lambda: f"1000 completed jobs (states: {jobs_by_state(runs)})")

    total, distinct, first, last = runs.execute(
        "SELECT count(*), count(DISTINCT key), min(at), max(at) FROM public.runs").fetchone()
    assert (total, distinct) == (1000, 1000)
    assert {r[0] for r in runs.execute("SELECT key FROM public.runs")} == set(keys)
    # attempts = 1 everywhere: nothing was delivered twice
    assert runs.execute("SELECT max(attempts) FROM pgbroker.jobs").fetchone()[0] == 1
    elapsed = (last - first).total_seconds()
    print(f"\n[figure] drained 1000 tasks with one worker (-c 2, prefetch 1) in {elapsed:.2f}s: "
          f"{999 / elapsed:.0f} tasks/s")
    assert worker.is_alive()


def test_publish_to_start_latency_on_idle_worker(producer: Celery, runs: psycopg.Connection,
                                                 broker_url: str) -> None:
    start_worker(broker_url)
    ids = [str(uuid.uuid4()) for _ in range(200)]
    for task_id in ids:
        e2e.touch.apply_async((task_id,), task_id=task_id)
        wait_for(lambda tid=task_id: key_runs(runs, tid), 30, interval=0.002,
                 message=f"the run of {task_id}")

    lags = [r[0] for r in runs.execute(
        "SELECT extract(epoch FROM r.at - j.created_at)::float8 FROM public.runs AS r"
        " JOIN pgbroker.jobs AS j ON j.task_id = r.key")]
    assert len(lags) == 200  # every task ran exactly once
    print(f"\n[figure] publish->start latency on an idle worker over {len(lags)} sequential "
          f"tasks (database clock): p50 {percentile(lags, 50) * 1000:.1f} ms, "
          f"p99 {percentile(lags, 99) * 1000:.1f} ms, max {max(lags) * 1000:.1f} ms")


def test_countdown_waits_in_the_database_until_due(producer: Celery, runs: psycopg.Connection,
                                                   broker_url: str) -> None:
    start_worker(broker_url)
    published = datetime.now(timezone.utc)
    result = e2e.touch.apply_async(("later",), countdown=3)

    row = job(runs, result.id)
    assert row["state"] == "scheduled"  # in the table, not in a worker's memory
    # eta = the producer's clock + 3 s, stored as run_at; created_at is the database's clock
    assert 3.0 <= (row["run_at"] - published).total_seconds() < 3.5, (row["run_at"], published)
    delay = (row["run_at"] - row["created_at"]).total_seconds()
    assert 2.0 < delay <= 3.05, f"run_at is {delay:.3f}s after created_at, expected ~3s"

    def ran() -> list:
        row_now = job(runs, result.id)
        done = key_runs(runs, "later")
        if not done:
            # not run yet: either still scheduled or its run_at has passed (promoted or claimed)
            assert row_now["state"] == "scheduled" or row_now["db_now"] >= row_now["run_at"], \
                row_now
        return done

    done = wait_for(ran, 30, interval=0.05, message="the countdown task to run")
    assert len(done) == 1
    row = wait_state(runs, result.id, "completed")
    assert done[0]["at"] >= row["run_at"], "the task ran before its countdown was over"
    lag = (done[0]["at"] - row["run_at"]).total_seconds()
    print(f"\n[figure] countdown=3: run_at - created_at = {delay:.3f}s; the task started "
          f"{lag * 1000:.0f} ms after run_at")
    assert key_runs(runs, "later") == done  # exactly once


def test_autoretry_with_backoff_and_jitter_finally_succeeds(producer: Celery,
                                                            runs: psycopg.Connection,
                                                            broker_url: str) -> None:
    worker = start_worker(broker_url)
    result = e2e.flaky.delay("flaky", 2)

    wait_for(lambda: runs.execute(
        "SELECT count(*) = 3 AND bool_and(state = 'completed') FROM pgbroker.jobs"
        " WHERE task_id = %s", (result.id,)).fetchone()[0], 60, interval=0.1,
        message="three completed deliveries of the flaky task")
    worker.wait_for_log(f"Task tests.apps.e2e_app.flaky[{result.id}] succeeded", 15)

    done = key_runs(runs, "flaky")
    assert [r["retries"] for r in done] == [0, 1, 2]
    # each retry is a new message with the same task id and retries + 1, delayed by the backoff
    rows = runs.execute("SELECT retries, attempts, state FROM pgbroker.jobs WHERE task_id = %s"
                        " ORDER BY retries", (result.id,)).fetchall()
    assert rows == [(0, 1, "completed"), (1, 1, "completed"), (2, 1, "completed")]
    assert worker.log().count(f"flaky[{result.id}] retry:") == 2


def _insert_raw(pg: psycopg.Connection, body: bytes, headers: object, task_id: str) -> None:
    """A Celery-shaped row written with SQL, as a foreign producer might write it."""
    pg.execute(
        "INSERT INTO pgbroker.jobs (id, queue, task, task_id, exchange, routing_key, body,"
        " content_type, content_encoding, headers, properties)"
        " VALUES (%s, 'celery', 'tests.apps.e2e_app.touch', %s, '', 'celery', %s,"
        " 'application/json', 'utf-8', %s::jsonb, %s::jsonb)",
        (uuid.uuid4(), task_id, body, json.dumps(headers),
         json.dumps({"correlation_id": task_id, "delivery_mode": 2, "priority": 0})))
    pg.execute("SELECT pg_notify('pgbroker.jobs', '0 celery')")


def _still_works(pg: psycopg.Connection, key: str) -> None:
    result = e2e.touch.delay(key)
    wait_state(pg, result.id, "completed")
    assert len(key_runs(pg, key)) == 1


def test_undecodable_body_goes_dead_and_worker_keeps_running(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    worker = start_worker(broker_url)
    bad = str(uuid.uuid4())
    _insert_raw(runs, b"\xff not json", {"task": "tests.apps.e2e_app.touch", "id": bad,
                                         "lang": "py", "argsrepr": "()", "kwargsrepr": "{}"},
                bad)

    row = wait_state(runs, bad, "dead")
    assert "undecodable" in row["last_error"], row["last_error"]
    assert row["attempts"] == 1
    assert not runs.execute("SELECT count(*) FROM public.runs").fetchone()[0]
    _still_works(runs, "after-undecodable")
    assert worker.is_alive()


def test_malformed_row_goes_dead_and_worker_keeps_running(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    worker = start_worker(broker_url)
    bad = str(uuid.uuid4())
    _insert_raw(runs, json.dumps([["x"], {}, {}]).encode(), ["headers", "are", "a", "list"], bad)

    row = wait_state(runs, bad, "dead")
    assert "malformed" in row["last_error"], row["last_error"]
    _still_works(runs, "after-malformed")
    assert worker.is_alive()


def test_unknown_task_goes_dead(producer: Celery, runs: psycopg.Connection,
                                broker_url: str) -> None:
    worker = start_worker(broker_url)
    result = producer.send_task("tests.apps.e2e_app.no_such_task", args=("x",))

    row = wait_state(runs, result.id, "dead")
    assert row["last_error"], row
    assert "unregistered task" in worker.log()
    _still_works(runs, "after-unknown")
