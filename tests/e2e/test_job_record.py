"""The record says what happened (issue 27, item 7), with real ``celery worker`` processes.

* A revoke with ``terminate=True`` that a thread pool cannot carry out (Celery's threads pool
  has no way to stop a running task: it runs to SUCCESS) leaves the job ``completed``, its
  ``revoked_at`` and last error saying that a revoke came while it ran -- not ``cancelled``. The
  prefork terminate that does kill it ends it ``cancelled``: tests/e2e/test_revoke.py.
* A task that sends two Celery retries and then fails leaves a chain of three jobs of one task
  id: two tries ``completed`` and flagged retried (their task went on in a new job), the last
  one ``dead``. ``pgbroker jobs show`` and the admin job page show the whole chain, and
  ``pgbroker stats`` counts 2 retried, 1 dead, 0 completed.
"""

from __future__ import annotations

import json
import re

import psycopg
from celery import Celery
from psycopg.rows import dict_row

from pgbroker.admin import create_app
from pgbroker.admin.auth import Credentials
from pgbroker.cli import main
from tests.apps import e2e_app as e2e
from tests.support.workers import job, key_runs, start_worker, wait_state
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


def test_a_task_that_retries_twice_then_fails_shows_its_chain_and_counts_as_retried(
        runs: psycopg.Connection, broker_url: str, db_url: str, producer: Celery,
        capsys) -> None:  # type: ignore[no-untyped-def]
    start_worker(broker_url)
    result = e2e.relapse.delay("relapse")
    chain = runs.cursor(row_factory=dict_row)
    query = ("SELECT id, retries, state, attempts, retried_attempt, last_error FROM pgbroker.jobs"
             " WHERE task_id = %s ORDER BY retries")
    wait_for(lambda: [r["state"] for r in chain.execute(query, (result.id,))]
             == ["completed", "completed", "dead"], 90, message="the chain of three tries")
    rows = chain.execute(query, (result.id,)).fetchall()
    assert [r["retries"] for r in rows] == [0, 1, 2]
    assert [r["retried_attempt"] for r in rows] == [1, 1, None]
    assert rows[0]["last_error"].startswith("retried: Retry in 0s: Transient('try 0 fails")
    assert "Transient: try 2 fails on purpose" in rows[2]["last_error"]
    assert len(key_runs(runs, "relapse")) == 3

    # pgbroker jobs show <task id>: the newest try, and the chain
    capsys.readouterr()
    assert main(["--database-url", db_url, "jobs", "show", result.id]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["id", str(rows[2]["id"])]
    lines = out[out.index("tries of Celery task id"):].splitlines()
    assert "(3;" in lines[0]
    assert [line.split()[:4] for line in lines[2:5]] == [
        ["0", str(rows[0]["id"]), "celery", "retried"],
        ["1", str(rows[1]["id"]), "celery", "retried"],
        ["2", str(rows[2]["id"]), "celery", "dead"]]
    # ... by the first try's job id too, which says it was retried
    assert main(["--database-url", db_url, "jobs", "show", str(rows[0]["id"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["retried"] is True and len(shown["chain"]) == 3

    # pgbroker stats: 2 retried, 1 dead, 0 completed
    assert main(["--database-url", db_url, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    (task,) = [t for t in stats["tasks"] if t["task"] == "tests.apps.e2e_app.relapse"]
    assert (task["retried"], task["dead"], task["completed"]) == (2, 1, 0)

    # the admin job page of the first try: every try, the first two retried
    login = {"user": "alice", "password": "correct horse battery"}
    app = create_app(db_url, credentials=Credentials(**login))
    try:
        client = app.test_client()
        token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text)[1]
        client.post("/login", data={**login, "csrf_token": token})
        html = client.get(f"/jobs/{rows[0]['id']}").text
    finally:
        app.extensions["pgbroker"].close()
    assert "Its tries (3)" in html and "Retried: this try ended by sending a Celery retry" in html
    body = html[html.index("Its tries (3)"):]
    assert body.count(">retried</span>") == 2 and ">dead</span>" in body
    for r in rows:
        assert str(r["id"]) in body
