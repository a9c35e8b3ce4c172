"""The record says what happened (issue 27, item 7), with real ``celery worker`` processes.

* A revoke with ``terminate=True`` that a thread pool cannot carry out (Celery's threads pool
  has no way to stop a running task: it runs to SUCCESS) leaves the job ``completed``, its
  ``revoked_at`` and last error saying that a revoke came while it ran -- not ``cancelled``. The
  prefork terminate that does kill it ends it ``cancelled``: tests/e2e/test_revoke.py.
"""

from __future__ import annotations

import re

import psycopg
from celery import Celery

from tests.e2e import app as e2e
from tests.e2e.support import job, key_runs, start_worker, wait_state
from tests.support.processes import wait_for


def test_a_terminate_the_thread_pool_cannot_carry_out_leaves_the_job_completed_with_a_note(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    worker = start_worker(broker_url, "-P", "threads", "-c", "2")
    running = e2e.nap.apply_async(("threaded", 6))
    wait_for(lambda: key_runs(runs, "threaded"), 60, message="the task to start")
    producer.control.revoke(running.id, terminate=True)
    assert job(runs, running.id)["revoked_at"] is not None, "revoked while it ran"
    worker.wait_for_log(f"Terminating {running.id}")

    row = wait_state(runs, running.id, "completed")
    assert key_runs(runs, "threaded:done"), "the thread pool ran it to its end"
    assert row["cancelled_attempt"] is None
    assert re.fullmatch(r"revoked by .* while running", row["last_error"]), row["last_error"]
    # the pool goes on, and the worker's revoke still holds for a copy of the same id
    after = e2e.touch.delay("after")
    wait_state(runs, after.id, "completed")
