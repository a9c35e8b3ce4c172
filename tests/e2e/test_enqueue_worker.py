"""End to end: jobs written by ``pgbroker.enqueue`` in the caller's transaction, run by a real
``celery worker`` of ``tests.apps.e2e_app``.

The worker polls only every 60 s here, so a job that runs within the 30 s wait was woken by the
NOTIFY its commit delivered, not found by polling. Latencies are printed (``pytest -s``), not
asserted; they are measured on the database clock, from just before the COMMIT to the task's run.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import psycopg
from celery import Celery

import pgbroker
from tests.apps import e2e_app as e2e
from tests.support.workers import key_runs, start_worker
from tests.support.processes import wait_for
from tests.support.enqueue import KINDS, Caller

NO_POLLING = {"poll_interval": 60}


def job_states(pg: psycopg.Connection, key: str) -> list[tuple[str, int, int]]:
    """(state, retries, attempts) of the jobs whose first argument is ``key``."""
    return pg.execute(
        "SELECT state, retries, attempts FROM pgbroker.jobs"
        " WHERE convert_from(body, 'UTF8')::jsonb -> 0 ->> 0 = %s ORDER BY retries",
        (key,)).fetchall()


def test_a_job_enqueued_in_a_transaction_runs_only_after_the_commit(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    worker = start_worker(broker_url, options=NO_POLLING)
    latencies: dict[str, float] = {}
    for kind in KINDS:
        caller = Caller(kind, db_url)
        try:
            key, gone = f"committed-{kind}", f"rolled-back-{kind}"
            pgbroker.enqueue(caller.db, e2e.touch, (key,))
            time.sleep(1.0)  # the worker is idle and listening: it must not see the job yet
            assert key_runs(runs, key) == [] and job_states(runs, key) == []
            [(before_commit,)] = caller.execute("SELECT clock_timestamp()")
            caller.commit()
            [run] = wait_for(lambda key=key: key_runs(runs, key), 30,
                             message=f"the run of {key} after its commit")
            latencies[kind] = (run["at"] - before_commit).total_seconds()

            pgbroker.enqueue(caller.db, e2e.touch, (gone,))
            caller.rollback()
        finally:
            caller.close()

    # A job committed after the rollbacks has run, so a rolled back one would have run too.
    with psycopg.connect(db_url) as conn:
        pgbroker.enqueue(conn, e2e.touch, ("marker",))
    wait_for(lambda: key_runs(runs, "marker"), 30, message="the marker's run")
    assert all(key_runs(runs, f"rolled-back-{kind}") == [] for kind in KINDS)
    assert "rolled-back" not in worker.log()  # never even received
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == len(KINDS) + 1
    print("\n[figure] commit -> task start with an idle worker (database clock, poll every 60 s): "
          + ", ".join(f"{kind} {ms * 1000:.1f} ms" for kind, ms in latencies.items()))


def test_the_worker_runs_the_message_as_celery_sent_it(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    """Arguments, task id, retries (self.retry makes a new row), eta and expires."""
    worker = start_worker(broker_url, options=NO_POLLING)
    eta = datetime.now(timezone.utc) + timedelta(seconds=2)
    with psycopg.connect(db_url) as conn:
        add_job = pgbroker.enqueue(conn, e2e.add, (2, 3))
        pgbroker.enqueue(conn, e2e.touch, ("at-eta",), eta=eta)
        pgbroker.enqueue(conn, e2e.touch, ("expired",), countdown=1.5, expires=0.5)
        pgbroker.enqueue(conn, e2e.flaky, ("flaky", 1))  # fails once, retried by autoretry_for

    wait_for(lambda: len(key_runs(runs, "flaky")) == 2, 30, message="flaky's retry")
    [at_eta] = wait_for(lambda: key_runs(runs, "at-eta"), 30, message="the run at the eta")
    [added] = key_runs(runs, "add:2:3")
    assert added["retries"] == 0
    task_id = runs.execute("SELECT task_id FROM pgbroker.jobs WHERE id = %s",
                           (add_job,)).fetchone()[0]
    worker.wait_for_log(f"Task tests.apps.e2e_app.add[{task_id}] succeeded", timeout=30)
    assert at_eta["at"] >= eta

    assert [r["retries"] for r in key_runs(runs, "flaky")] == [0, 1]
    # the retry is a second row (same task id, retries + 1), not a requeue of the first
    wait_for(lambda: job_states(runs, "flaky") == [("completed", 0, 1), ("completed", 1, 1)], 30,
             message=lambda: f"both flaky rows completed: {job_states(runs, 'flaky')}")

    # Due after it expired: never delivered (attempts 0), never run.
    assert key_runs(runs, "expired") == []
    [(state, _, attempts)] = job_states(runs, "expired")
    assert attempts == 0 and state in ("pending", "scheduled", "expired")
