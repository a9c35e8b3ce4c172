"""Durable revoke with real ``celery worker`` processes (issue 17, point 8; celery#818, #4300).

Celery keeps revoked ids in each worker's memory only: a task revoked while it waited for its
eta ran anyway once its worker restarted, and a revoke sent while no worker ran reached nobody.
Over pgbroker the revoke is also written to the jobs (pgbroker._produce.revoke): a job not yet
claimed is cancelled, a claimed one (running, or prefetched in a worker's memory) is flagged and
ends cancelled however its delivery ends. Each test checks runs with SQL (``public.runs``), never
the worker's word. The same rules without workers: tests/integration/test_revoke.py.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.support.control import REPLY_TIMEOUT, celery_cli
from tests.support.workers import SHORT_LEASE, job, key_runs, start_worker, wait_state
from tests.support.processes import wait_for


def revoke_audits(pg: psycopg.Connection) -> int:
    return pg.execute("SELECT count(*) FROM pgbroker.audit WHERE action = 'job.revoke'"
                      ).fetchone()[0]


def test_a_revoked_job_never_runs_though_no_worker_ran_or_its_worker_restarted(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    # revoked while no worker runs: no mailbox to tell, the jobs are cancelled all the same
    early = e2e.touch.apply_async(("early",))
    early_later = e2e.touch.apply_async(("early-later",), countdown=1)
    producer.control.revoke([early.id, early_later.id])
    assert {job(runs, r.id)["state"] for r in (early, early_later)} == {"cancelled"}

    # revoked while its worker waits for its eta (the worker holds the id in memory) ...
    worker = start_worker(broker_url)
    later = e2e.touch.apply_async(("later",), countdown=8)
    producer.control.revoke(later.id)
    worker.wait_for_log(f"Tasks flagged as revoked: {later.id}")
    assert job(runs, later.id)["state"] == "cancelled"
    # ... then that worker restarts before the eta: the new one has no memory of the revoke
    worker.stop()
    row = job(runs, later.id)
    assert row["run_at"] > row["db_now"], "the test needs the eta to pass after the restart"
    worker = start_worker(broker_url)
    # due after every revoked job, in the same queue: when it has run, they had their chance
    sentinel = e2e.touch.apply_async(("sentinel",), eta=row["run_at"] + timedelta(seconds=0.5))
    wait_state(runs, sentinel.id, "completed")
    for result, key in ((early, "early"), (early_later, "early-later"), (later, "later")):
        assert key_runs(runs, key) == []
        assert job(runs, result.id)["state"] == "cancelled"
        assert job(runs, result.id)["attempts"] == 0  # never even delivered

    # an unknown id and a finished task's: nothing changes, and the revoking process says so
    audits = revoke_audits(runs)
    done = celery_cli(broker_url, "control", "revoke", "no-such-task-id", sentinel.id,
                      "-t", str(REPLY_TIMEOUT))
    assert "revoke of task id(s) no-such-task-id: no job has this task id, nothing changed" \
        in done.stderr
    assert f"revoke of task id(s) {sentinel.id} (completed): already finished, nothing " \
           "changed" in done.stderr
    assert job(runs, sentinel.id)["state"] == "completed"
    assert revoke_audits(runs) == audits


def test_a_revoked_prefetched_job_never_runs_after_its_worker_is_killed_and_terminate_cancels(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    first = start_worker(broker_url, "-c", "1", "--prefetch-multiplier", "2",
                         options=SHORT_LEASE)
    blocker = e2e.nap.apply_async(("blocker", 120))
    prefetched = e2e.touch.apply_async(("prefetched",))
    wait_for(lambda: key_runs(runs, "blocker"), 60, message="the blocker to start")
    wait_state(runs, prefetched.id, "running")  # claimed: waiting in the worker's memory
    producer.control.revoke(prefetched.id)
    first.wait_for_log(f"Tasks flagged as revoked: {prefetched.id}")
    assert job(runs, prefetched.id)["revoked_at"] is not None

    # SIGKILL: the worker and its pool vanish with the revoke in their memory; the next worker's
    # sweeper rescues their deliveries: the blocker runs again, the revoked job ends cancelled
    first.kill_group()
    second = start_worker(broker_url, "-c", "1", options=SHORT_LEASE)
    wait_state(runs, prefetched.id, "cancelled")
    wait_for(lambda: len(key_runs(runs, "blocker")) == 2, 60,
             message="the blocker to run again on the second worker")
    assert key_runs(runs, "prefetched") == []

    # terminate=True: Celery sends SIGTERM to the pool process running the task; its job ends
    # cancelled -- not completed, not dead, not redelivered
    producer.control.revoke(blocker.id, terminate=True)
    second.wait_for_log(f"Terminating {blocker.id}")
    row = wait_state(runs, blocker.id, "cancelled")
    assert row["attempts"] == 2 and row["revoked_at"] is not None
    # (the worker said it terminated it: Celery's task_revoked, pgbroker._celery.endings)
    assert row["cancelled_attempt"] == 2
    assert row["last_error"].endswith("while running; its worker terminated it (signal 15) "
                                      "before it finished"), row["last_error"]
    assert key_runs(runs, "blocker:done") == []
    # the pool goes on: a task sent now runs
    after = e2e.touch.delay("after")
    wait_state(runs, after.id, "completed")
    assert job(runs, blocker.id)["state"] == "cancelled"
    assert len(key_runs(runs, "blocker")) == 2
