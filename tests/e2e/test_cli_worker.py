"""``pgbroker`` commands against real ``celery worker`` processes: a paused queue is not claimed,
and a retried dead job runs (the commands alone: tests/integration/test_cli.py). The commands run
in-process (the ``cli`` fixture), the workers are the e2e app's.
"""

from __future__ import annotations

import json

import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.support.processes import Run, wait_for
from tests.support.workers import job, key_runs, start_worker


def test_a_paused_queue_is_not_claimed_by_a_real_worker(cli: Run, producer: Celery,
                                                        runs: psycopg.Connection) -> None:
    worker = start_worker(producer.conf.broker_url, "-Q", "celery,other")
    assert cli("pause", "celery")[0] == 0
    held = e2e.touch.apply_async(args=["held"], queue="celery")
    e2e.touch.apply_async(args=["control"], queue="other")
    # The worker consumes both queues: once the later job of the other queue has run, the
    # paused one had every chance to be claimed first.
    wait_for(lambda: key_runs(runs, "control"), 60, message="the control job to run")
    assert key_runs(runs, "held") == []
    assert job(runs, held.id)["state"] == "pending"
    assert cli("resume", "celery")[0] == 0
    wait_for(lambda: key_runs(runs, "held"), 60, message="the held job to run after resume")
    worker.stop()


def test_dead_letters_from_a_real_worker(cli: Run, producer: Celery,
                                         runs: psycopg.Connection) -> None:
    worker = start_worker(producer.conf.broker_url)
    # A task that raises: dead with its error and traceback, retried, run again.
    failed = e2e.boom.apply_async(args=["boom-1"])
    wait_for(lambda: job(runs, failed.id)["state"] == "dead", 60, message="boom to go dead")
    code, out, _ = cli("dead", "list")
    [row] = out.splitlines()[1:]
    assert "ValueError: boom boom-1" in row and "POISON" not in row
    code, out, _ = cli("jobs", "show", failed.id)
    assert "Traceback" in out
    job_id = job(runs, failed.id)["id"]
    assert cli("dead", "retry", str(job_id))[0] == 0
    wait_for(lambda: len(key_runs(runs, "boom-1")) == 2, 60, message="the retried run")
    wait_for(lambda: job(runs, failed.id)["state"] == "dead", 60, message="dead again")
    assert job(runs, failed.id)["attempts"] == 1  # a fresh start, not attempt 2

    # A job whose first attempt failed (the state the failure hook leaves), retried: it must
    # complete, not be buried again by the failure recorded for its old attempt 1.
    assert cli("pause", "celery")[0] == 0
    sent = e2e.touch.apply_async(args=["second-chance"])
    wait_for(lambda: job(runs, sent.id), 30, message="the job row")
    runs.execute("UPDATE pgbroker.jobs SET state = 'dead', attempts = 1, failed_attempt = 1,"
                 " last_error = 'Transient: first try' WHERE task_id = %s", (sent.id,))
    assert cli("resume", "celery")[0] == 0
    assert cli("dead", "retry", "--all")[0] == 0
    wait_for(lambda: job(runs, sent.id)["state"] == "completed", 60,
             message=lambda: f"the retried job to complete ({job(runs, sent.id)['state']})")

    # A poison job: it kills its pool process on every delivery (2 here).
    poison = e2e.suicide.apply_async(args=["poison-1"], headers={"max_attempts": 2})
    wait_for(lambda: job(runs, poison.id)["state"] == "dead", 120, message="poison to go dead")
    code, out, _ = cli("dead", "list", "--json")
    flags = {r["task_id"]: r["poison"] for r in json.loads(out)}
    assert flags == {poison.id: True, failed.id: False}
    assert len(key_runs(runs, "poison-1")) == 2
    worker.stop()
