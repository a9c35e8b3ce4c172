"""A task name whose deliveries keep losing their worker pauses itself; pgbroker's signals
(issue 22, points 4 and 5), with real ``celery worker`` processes whose pool processes kill
themselves, and whole workers killed with SIGKILL.

The receivers of ``tests.e2e.jobsem_app`` write every ``job_dead`` and ``task_paused`` they get to
``public.signals``, with the pid of the process that sent it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import psycopg
from celery import Celery
from psycopg.rows import dict_row

from pgbroker.ops import Operations
from tests.e2e import jobsem_app as app_module
from tests.e2e.jobsem_support import producer, worker  # noqa: F401 - fixture
from tests.support.db import job_fields, job_state
from tests.support.workers import SHORT_LEASE
from tests.support.processes import WorkerProcess, wait_for

OPTIONS = {**SHORT_LEASE, "pause_task_after": 3}
CRASH = "tests.e2e.jobsem_app.crash"


def _worker(broker_url: str, *args: str) -> WorkerProcess:
    return worker(broker_url, OPTIONS, *args)


def _runs(pg: psycopg.Connection, task: str) -> int:
    return pg.execute("SELECT count(*) FROM public.runs WHERE task = %s", (task,)).fetchone()[0]


def _signals(pg: psycopg.Connection, kind: str) -> list[dict[str, Any]]:
    return pg.cursor(row_factory=dict_row).execute(
        "SELECT * FROM public.signals WHERE kind = %s ORDER BY n", (kind,)).fetchall()


def _paused(pg: psycopg.Connection) -> dict[str, dict[str, Any]]:
    rows = pg.cursor(row_factory=dict_row).execute("SELECT * FROM pgbroker.task_pauses")
    return {r["task"]: r for r in rows}


def test_pool_process_killed_three_times_in_a_row_pauses_the_task(
        producer: Celery, broker_url: str, pg: psycopg.Connection, db_url: str) -> None:  # noqa: F811
    worker = _worker(broker_url)
    app_module.crash.apply_async(("c1",), task_id="c1", headers={"max_attempts": 20})
    wait_for(lambda: _paused(pg), 90, message="the crash task to be paused")
    pause = _paused(pg)[CRASH]
    assert pause["paused_by"] == "pgbroker"
    assert "3 deliveries in a row killed their pool process (Celery's WorkerLostError" \
        in pause["reason"]
    assert [str(j) for j in pause["job_ids"]] == [
        str(pg.execute("SELECT id FROM pgbroker.jobs WHERE task_id = 'c1'").fetchone()[0])]

    # not claimed any more; other tasks keep running on the same worker
    runs = _runs(pg, "crash")
    assert runs == 3
    for i in range(4):
        app_module.ok.apply_async((f"ok{i}",), task_id=f"ok{i}")
    # c1, due and older than the ok jobs, comes first in the claim's order: the claims that
    # took the four passed it over
    wait_for(lambda: _runs(pg, "ok") == 4, 30)
    assert _runs(pg, "crash") == 3
    assert job_fields(pg, "state", "attempts", task_id="c1") == ("pending", 3)

    # signalled once, in the worker's main process; a CRITICAL line in its log
    paused = _signals(pg, "task_paused")
    assert [(s["task"], s["actor"]) for s in paused] == [(CRASH, "pgbroker")]
    assert paused[0]["pid"] == worker.pid
    assert [str(j) for j in paused[0]["job_ids"]] == [str(j) for j in pause["job_ids"]]
    worker.wait_for_log("CRITICAL")
    assert f"task '{CRASH}' is PAUSED" in worker.log()

    # resumed by the Python call, audited with who and why: it runs (and pauses) again
    with psycopg.connect(db_url, autocommit=True) as conn:
        ops = Operations(conn, actor="alice", via="test")
        assert [t["task"] for t in ops.paused_tasks()] == [CRASH]
        assert ops.paused_tasks()[0]["waiting"] == 1
        assert ops.resume_task(CRASH, "fixed the bug")
        assert not ops.resume_task(CRASH, "again")
    wait_for(lambda: _runs(pg, "crash") >= 4, 30, message="the resumed task to run again")
    wait_for(lambda: len(_signals(pg, "task_paused")) == 2, 60,
             message="a second pause after three more losses")
    assert _runs(pg, "crash") == 6
    audit = pg.execute("SELECT actor, action, detail->>'reason', (detail->>'changed')::bool "
                       "FROM pgbroker.audit WHERE target = %s ORDER BY id", (CRASH,)).fetchall()
    assert [a[:2] for a in audit] == [("pgbroker", "task.pause"), ("alice", "task.resume"),
                                      ("alice", "task.resume"), ("pgbroker", "task.pause")]
    assert audit[1][2:] == ("fixed the bug", True)
    assert audit[2][3] is False
    worker.stop()


def test_a_completed_delivery_ends_the_streak(producer: Celery, broker_url: str,  # noqa: F811
                                              pg: psycopg.Connection) -> None:
    """Two losses, a success, two losses: never three in a row, never paused."""
    worker = _worker(broker_url, "-c", "1")
    for round_ in range(2):
        for i in range(2):
            app_module.crash.apply_async((f"r{round_}-{i}",), task_id=f"r{round_}-{i}",
                                         headers={"max_attempts": 1})
        wait_for(lambda: pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task = %s AND "
                                    "state = 'dead'", (CRASH,)).fetchone()[0] == 2 * (round_ + 1),
                 60)
        # (each loss is counted just after its requeue made the job dead)
        wait_for(lambda: pg.execute("SELECT streak FROM pgbroker.task_losses WHERE task = %s",
                                    (CRASH,)).fetchone() == (2,), 10, message="a streak of 2")
        # a completed delivery of the same task name ends the streak
        app_module.crash.apply_async((f"survive{round_}",), task_id=f"survive{round_}")
        wait_for(lambda: job_state(pg, f"survive{round_}") == "completed", 30)
        assert pg.execute("SELECT count(*) FROM pgbroker.task_losses").fetchone()[0] == 0
    assert not _paused(pg)
    worker.stop()


def test_lost_worker_failures_and_sweeper_rescues_count_and_signal(
        producer: Celery, broker_url: str, pg: psycopg.Connection) -> None:  # noqa: F811
    """Without task_reject_on_worker_lost Celery fails the task (WorkerLostError): each counts,
    and each dead job is signalled. A whole worker SIGKILLed: the sweeper rescues its job,
    counts the loss, and signals the job dead when it was its last attempt."""
    worker = _worker(broker_url, "-c", "1")
    for i in range(3):
        app_module.crash_acked.apply_async((f"a{i}",), task_id=f"a{i}")
    name = "tests.e2e.jobsem_app.crash_acked"
    wait_for(lambda: name in _paused(pg), 60, message="crash_acked to be paused")
    # (the failure hook counts the loss just before the ack makes the job dead)
    wait_for(lambda: len([s for s in _signals(pg, "job_dead") if s["task"] == name]) == 3, 30)
    dead = [s for s in _signals(pg, "job_dead") if s["task"] == name]
    assert len(dead) == 3 and all(s["pid"] == worker.pid for s in dead)
    assert all("WorkerLostError" in s["reason"] for s in dead)

    # a task that raises: dead, signalled once from the worker's main process
    app_module.boom.apply_async(("b",), task_id="b")
    wait_for(lambda: any(s["task"].endswith(".boom") for s in _signals(pg, "job_dead")), 30)
    boom = [s for s in _signals(pg, "job_dead") if s["task"].endswith(".boom")]
    assert len(boom) == 1 and "boom b" in boom[0]["reason"] and boom[0]["attempts"] == 1

    # the whole worker killed on the job's last attempt: the next worker's sweeper
    app_module.hang.apply_async(("h",), task_id="h", headers={"max_attempts": 1})
    wait_for(lambda: _runs(pg, "hang") == 1, 30)
    worker.kill_group()
    worker.wait(10)
    second = _worker(broker_url, "-c", "1")
    wait_for(lambda: any(s["task"].endswith(".hang") for s in _signals(pg, "job_dead")), 30)
    hang = [s for s in _signals(pg, "job_dead") if s["task"].endswith(".hang")]
    assert len(hang) == 1 and hang[0]["pid"] == second.pid
    assert "consumer was lost" in hang[0]["reason"]
    # (a whole worker lost: one worker on the record, no pool-process streak)
    wait_for(lambda: pg.execute("SELECT streak, workers FROM pgbroker.task_losses WHERE task = %s",
                                ("tests.e2e.jobsem_app.hang",)).fetchone()
             == (0, [socket.gethostname()]), 10, message="the rescue to count as a loss")
    time.sleep(1)  # room for a second signal, were one sent: nothing marks its absence
    assert len([s for s in _signals(pg, "job_dead") if s["task"].endswith(".hang")]) == 1
    second.stop()


def test_pgbroker_sweep_signals_in_its_own_process(producer: Celery, broker_url: str,  # noqa: F811
                                                   pg: psycopg.Connection, db_url: str) -> None:
    """``pgbroker -A app sweep`` imports the app's modules, so their receivers hear the jobs it
    makes dead: the signal comes from the CLI's process."""
    import subprocess
    import sys
    import uuid as uuid_

    from tests.support.processes import REPO_ROOT, _env

    consumer = uuid_.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues, lock_key) "
               "VALUES (%s, 'gone', 1, '{celery}', 4242)", (consumer,))
    job = uuid_.uuid4()
    pg.execute("INSERT INTO pgbroker.jobs (id, queue, task, body, state, attempts, max_attempts, "
               "locked_by) VALUES (%s, 'celery', 'tests.e2e.jobsem_app.hang', '\\x7b7d', "
               "'running', 2, 2, %s)", (job, consumer))
    proc = subprocess.run([sys.executable, "-m", "pgbroker", "-A", "tests.e2e.jobsem_app",
                           "sweep"], cwd=REPO_ROOT, env=_env(broker_url, None),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [dead] = _signals(pg, "job_dead")
    assert dead["job_id"] == job and dead["attempts"] == 2
    assert dead["pid"] not in (os.getpid(),)
    assert "consumer was lost" in dead["reason"]
