"""Whole-worker losses pause no innocent task type (issue 27, item 3), with real ``celery worker``
processes (``-c 2``, acks late, ``task_reject_on_worker_lost``) of ``tests.e2e.jobsem_app``:

* six SIGKILLs of a whole worker running the only task type in the queue pause nothing (one
  worker killed again and again is no evidence against its task);
* a worker told to stop (SIGTERM: a rolling deploy; a warm or a soft shutdown) and killed when
  its grace period runs out adds no loss;
* a task that kills its pool process five times in a row pauses its type, with a reason that
  names Celery's WorkerLostError, logged in the worker that paused it; one that gives its
  message back (``Reject(requeue=True)``) six times, its pool process alive, pauses nothing.

Figures (printed with ``-s``) go to docs/chaos.md.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.rows import dict_row

from tests.e2e import jobsem_app as app_module
from tests.e2e.jobsem_support import producer, worker  # noqa: F401 - fixture
from tests.support.workers import SHORT_LEASE
from tests.support.processes import WorkerProcess, run_worker, wait_for

OPTIONS = {**SHORT_LEASE, "pause_task_after": 5}
HANG = "tests.e2e.jobsem_app.hang"
CRASH = "tests.e2e.jobsem_app.crash"


def _worker(broker_url: str) -> WorkerProcess:
    return worker(broker_url, OPTIONS, "-c", "2")


def _runs(pg: psycopg.Connection, task: str) -> int:
    return pg.execute("SELECT count(*) FROM public.runs WHERE task = %s", (task,)).fetchone()[0]


def _pauses(pg: psycopg.Connection) -> dict[str, dict[str, Any]]:
    rows = pg.cursor(row_factory=dict_row).execute("SELECT * FROM pgbroker.task_pauses")
    return {r["task"]: r for r in rows}


def _losses(pg: psycopg.Connection) -> dict[str, tuple[int, list[str]]]:
    return {task: (streak, workers) for task, streak, workers in pg.execute(
        "SELECT task, streak, workers FROM pgbroker.task_losses")}


def _hang_twice(pg: psycopg.Connection) -> None:
    """The only task type in the queue: two jobs that run until their worker is killed."""
    for i in range(2):
        app_module.hang.apply_async((f"h{i}",), task_id=f"h{i}", headers={"max_attempts": 50})


def test_six_whole_worker_kills_pause_nothing(producer: Celery, broker_url: str,  # noqa: F811
                                              pg: psycopg.Connection) -> None:
    _hang_twice(pg)
    started = time.monotonic()
    for kill in range(1, 7):
        victim = _worker(broker_url)  # the next one's sweeper rescues the last one's jobs
        wait_for(lambda: _runs(pg, "hang") >= 2 * kill or _pauses(pg), 60,
                 message=f"both jobs running on worker {kill}")
        assert not _pauses(pg), f"paused after {kill - 1} whole-worker kill(s)"
        victim.kill_group(signal.SIGKILL)
        victim.wait(10)
    last = _worker(broker_url)
    wait_for(lambda: _runs(pg, "hang") >= 14 or _pauses(pg), 60,
             message="the sixth kill's jobs to run again")
    print(f"\n[figure] 6 SIGKILLs of a -c 2 worker, 12 deliveries lost in "
          f"{time.monotonic() - started:.0f} s: {len(_pauses(pg))} task(s) paused, "
          f"losses on record {_losses(pg)}")
    assert not _pauses(pg)
    assert _losses(pg) == {HANG: (0, [socket.gethostname()])}  # one worker, again and again
    assert pg.execute("SELECT max(attempts) FROM pgbroker.jobs").fetchone() == (7,)
    last.kill_group(signal.SIGKILL)


@pytest.mark.parametrize("shutdown", ["warm", "soft"])
def test_a_worker_told_to_stop_then_killed_adds_no_loss(producer: Celery, broker_url: str,  # noqa: F811
                                                        pg: psycopg.Connection,
                                                        shutdown: str) -> None:
    """A rolling deploy: SIGTERM, the tasks run on, SIGKILL when the grace period ends. Warm:
    Celery's default. Soft: ``REMAP_SIGTERM=SIGQUIT`` and ``worker_soft_shutdown_timeout``, a
    wait inside Celery's signal handler, before its ``worker_shutting_down``."""
    _hang_twice(pg)
    env = {"PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(OPTIONS)}
    if shutdown == "soft":
        env.update(REMAP_SIGTERM="SIGQUIT", PGBROKER_TEST_SOFT_SHUTDOWN="60")
    deployed = run_worker("tests.e2e.jobsem_app", broker_url, "-c", "2", env=env).wait_ready(60)
    wait_for(lambda: _runs(pg, "hang") == 2, 60, message="both jobs running")
    deployed.kill(signal.SIGTERM)  # the tasks run on...
    deployed.wait_for_log("consumer(s) marked stopping")
    if shutdown == "soft":
        deployed.wait_for_log("Initiating Soft Shutdown")
    deployed.kill_group(signal.SIGKILL)  # ...until the grace period ends
    deployed.wait(10)
    killed = time.monotonic()
    successor = _worker(broker_url)
    wait_for(lambda: _runs(pg, "hang") == 4, 60, message="the jobs to run again")
    print(f"\n[figure] {shutdown} shutdown (SIGTERM), then SIGKILL at the end of the grace "
          f"period: both jobs running on the successor {time.monotonic() - killed:.1f} s after "
          f"the kill (its start included); losses on record {_losses(pg)}, pauses "
          f"{len(_pauses(pg))}")
    assert not _losses(pg) and not _pauses(pg)
    successor.kill_group(signal.SIGKILL)


def test_a_task_that_kills_its_pool_process_five_times_pauses_its_type(
        producer: Celery, broker_url: str, pg: psycopg.Connection) -> None:  # noqa: F811
    paused_by = _worker(broker_url)
    started = time.monotonic()
    app_module.crash.apply_async(("c1",), task_id="c1", headers={"max_attempts": 20})
    wait_for(lambda: _pauses(pg), 120, message="the crash task to be paused")
    print(f"\n[figure] a task that SIGKILLs its pool process: paused after "
          f"{_runs(pg, 'crash')} runs, {time.monotonic() - started:.0f} s")
    pause = _pauses(pg)[CRASH]
    assert _runs(pg, "crash") == 5
    assert pause["reason"].startswith("5 deliveries in a row killed their pool process "
                                      "(Celery's WorkerLostError")
    job = pg.execute("SELECT id FROM pgbroker.jobs WHERE task_id = 'c1'").fetchone()[0]
    assert [str(j) for j in pause["job_ids"]] == [str(job)] and str(job) in pause["reason"]
    paused_by.wait_for_log(f"task '{CRASH}' is PAUSED: 5 deliveries in a row killed their "
                           "pool process")
    paused_by.stop()


def test_a_task_that_rejects_with_requeue_pauses_nothing(producer: Celery, broker_url: str,  # noqa: F811
                                                         pg: psycopg.Connection) -> None:
    """A requeue alone is no evidence: only Celery's WorkerLostError, seen in the request,
    says that the pool process died."""
    worker = _worker(broker_url)
    app_module.reject_again.apply_async(("r",), task_id="r", headers={"max_attempts": 6})
    wait_for(lambda: pg.execute("SELECT state FROM pgbroker.jobs WHERE task_id = 'r'"
                                ).fetchone() == ("dead",) or _pauses(pg), 60,
             message="the job to use up its attempts")
    assert not _pauses(pg) and not _losses(pg)
    assert _runs(pg, "reject_again") == 6
    worker.stop()
