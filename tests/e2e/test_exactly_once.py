"""pgbroker.complete(): a task's writes and its delivery's completion commit together (issue 22,
point 7), with real ``celery worker`` processes killed (SIGKILL, the whole process group) before,
during and after the task's COMMIT. Each time the task's rows are counted: exactly one.

* before: the task wrote and completed in its transaction, which was never committed -- the
  job is redelivered (to a second worker) and that run commits;
* during: the worker dies while the server runs the COMMIT (a deferred trigger makes it last
  4 s): the server finishes it, and the job is never run again;
* after: the task committed and the worker dies before its ack: never redelivered, the job stays
  ``completed`` at attempt 1.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from celery import Celery

from tests.e2e import jobsem_app as app_module
from tests.e2e.jobsem_support import producer, worker  # noqa: F401 - fixture
from tests.support.db import job_fields, job_state
from tests.support.workers import SHORT_LEASE
from tests.support.processes import WorkerProcess, wait_for

OPTIONS = SHORT_LEASE
#: What a job row says of its outcome: (state, attempts, completed_attempt).
OUTCOME = ("state", "attempts", "completed_attempt")


def _worker(broker_url: str) -> WorkerProcess:
    return worker(broker_url, OPTIONS, "-c", "1")


def _phase_reached(pg: psycopg.Connection, key: str, phase: str) -> bool:
    return bool(pg.execute("SELECT 1 FROM public.phases WHERE key = %s AND phase = %s",
                           (key, phase)).fetchone())


def _rows(pg: psycopg.Connection, key: str) -> list[int]:
    return [r[0] for r in pg.execute(
        "SELECT attempt FROM public.exact_rows WHERE key = %s ORDER BY n", (key,))]


def _committing(pg: psycopg.Connection) -> bool:
    """A backend of this database is running a COMMIT (the slow deferred trigger)."""
    return bool(pg.execute(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND state = 'active' AND query ILIKE 'commit%%'").fetchone())


@pytest.mark.parametrize("stop,driver", [("before", "psycopg"), ("during", "psycopg"),
                                         ("after", "psycopg"), ("before", "sqlalchemy"),
                                         ("after", "sqlalchemy")])
def test_killed_worker_runs_the_task_exactly_once(producer: Celery, broker_url: str,  # noqa: F811
                                                  pg: psycopg.Connection, stop: str,
                                                  driver: str) -> None:
    key = f"exact-{stop}-{driver}"
    first = _worker(broker_url)
    app_module.write_once.apply_async((key, stop, driver), task_id=key)

    if stop == "before":
        wait_for(lambda: _phase_reached(pg, key, "completed-in-tx"), 60)
        # the completion is in the open transaction: nobody else sees it yet
        assert job_state(pg, key) == "running"
    elif stop == "during":
        wait_for(lambda: _phase_reached(pg, key, "committing"), 60)
        wait_for(lambda: _committing(pg), 10, interval=0.02)
    else:
        wait_for(lambda: _phase_reached(pg, key, "committed"), 60)
    first.kill_group()
    first.wait(10)

    second = _worker(broker_url)
    if stop == "before":
        # rolled back with the connection: redelivered, and the second run commits
        wait_for(lambda: _rows(pg, key) == [2], 60,
                 message=lambda: f"one row, of attempt 2 (rows: {_rows(pg, key)})")
        wait_for(lambda: job_state(pg, key) == "completed", 30)
        assert job_fields(pg, *OUTCOME, task_id=key) == ("completed", 2, 2)
    else:
        # the commit went through (during: the server finished it after the client died)
        wait_for(lambda: job_state(pg, key) == "completed", 30)
        assert job_fields(pg, *OUTCOME, task_id=key) == ("completed", 1, 1)
        # the second worker's sweeper found the dead consumer and rescued nothing
        wait_for(lambda: pg.execute("SELECT count(*) FROM pgbroker.consumers").fetchone()[0] == 1,
                 30, message="the killed worker's consumer to be removed")
        time.sleep(2)  # a few more sweeps
        assert job_fields(pg, *OUTCOME, task_id=key) == ("completed", 1, 1)
    assert len(_rows(pg, key)) == 1, _rows(pg, key)
    second.stop()
    assert len(_rows(pg, key)) == 1


def test_late_failure_and_bad_use(producer: Celery, broker_url: str,  # noqa: F811
                                  pg: psycopg.Connection) -> None:
    """A task that raises after completing and committing stays completed (its hook changes
    nothing); completing on an autocommit connection is refused, and the job is dead with why."""
    worker = _worker(broker_url)
    app_module.complete_then_fail.apply_async(("late",), task_id="late")
    app_module.complete_autocommit.apply_async(("auto",), task_id="auto")
    wait_for(lambda: pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE state IN "
                                "('completed', 'dead')").fetchone()[0] == 2, 60)
    worker.stop()
    assert job_fields(pg, *OUTCOME, task_id="late") == ("completed", 1, 1)
    assert _rows(pg, "late") == [1]
    state, error = pg.execute("SELECT state, last_error FROM pgbroker.jobs "
                              "WHERE task_id = 'auto'").fetchone()
    assert state == "dead"
    assert "autocommit" in error


def test_complete_outside_a_task_is_refused(pg: psycopg.Connection) -> None:
    import pgbroker

    with pytest.raises(pgbroker.DeliveryLost, match="from a task"):
        pgbroker.complete(pg)
