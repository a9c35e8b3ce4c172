"""The admin page's paused task names (issue 22, point 4): shown with why, by whom, the jobs that
caused it, and a Resume button (audited with the logged-in user and the reason typed); the dead
letters page counts a task's runs across Celery's retries (point 5)."""

from __future__ import annotations

import psycopg
from flask.testing import FlaskClient

from pgbroker.ops import Operations
from tests.support.admin import csrf
from tests.support.db import add_job


def test_a_paused_task_is_shown_with_its_jobs_and_resumed_by_the_button(
        client: FlaskClient, pg: psycopg.Connection, db_url: str) -> None:
    job = add_job(pg, "pending", task="t.poison")
    # as pgbroker pauses it (task_loss_record): its jobs named
    pg.execute("INSERT INTO pgbroker.task_pauses (task, paused_by, reason, job_ids) "
               "VALUES ('t.poison', 'pgbroker', '5 deliveries in a row killed their pool process "
               "(Celery''s WorkerLostError)', ARRAY[%s]::uuid[])", (job,))
    page = client.get("/").text
    assert 'data-task="t.poison"' in page
    assert "5 deliveries in a row killed their pool process" in page
    # what counts towards such a pause, and what does not (0019_loss_evidence.sql)
    assert "What pauses a task" in page and "counts against no task" in page
    assert f'/jobs/{job}"' in page and "1 job(s) waiting" in page
    response = client.post("/tasks/resume", data={"task": "t.poison", "reason": "fixed in 1.4.2",
                                                  "csrf_token": csrf(client)})
    assert response.status_code == 303
    assert pg.execute("SELECT count(*) FROM pgbroker.task_pauses").fetchone() == (0,)
    actor, reason, was = pg.execute(
        "SELECT actor, detail->>'reason', detail->'was'->>'paused_by' FROM pgbroker.audit "
        "WHERE action = 'task.resume'").fetchone()
    assert (actor, reason, was) == ("alice", "fixed in 1.4.2", "pgbroker")
    assert 'data-task="t.poison"' not in client.get("/").text


def test_dead_letters_show_runs_across_retries(client: FlaskClient,
                                               pg: psycopg.Connection) -> None:
    for retries in range(4):
        add_job(pg, "completed" if retries < 3 else "dead", task="t.flaky", task_id="tid-9",
                retries=retries, attempts=1, last_error="boom" if retries == 3 else None)
    page = client.get("/dead").text
    assert "<th" in page and ">Runs</th>" in page
    assert '<td class="n">4 <span class="meta">(3 retries)</span></td>' in page


def test_resuming_an_unpaused_task_says_so(client: FlaskClient, db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        Operations(conn, actor="x", via="test").pause_task("t.other", "test")
    client.post("/tasks/resume", data={"task": "t.other", "csrf_token": csrf(client)})
    response = client.post("/tasks/resume", data={"task": "t.other", "csrf_token": csrf(client)},
                           follow_redirects=True)
    assert "Task t.other was not paused." in response.text
