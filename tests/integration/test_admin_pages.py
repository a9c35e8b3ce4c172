"""The admin page's jobs browser and bulk actions, a job's history across Celery retries, the
workers page and the beat page, through Flask's test client over a real database.

(The same in a real browser, with a real worker and beat: tests/e2e/test_admin_browser.py.)
"""

from __future__ import annotations

import random
import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from flask.testing import FlaskClient
from psycopg.types.json import Jsonb

from pgbroker.beat import Schedules
from pgbroker.ops import JobFilter, Operations
from tests.support.admin import csrf
from tests.support.db import add_job


def uuid7_at(t: datetime) -> uuid.UUID:
    """A UUIDv7 made at ``t``, as the transport's ids are."""
    ms = int(t.timestamp() * 1000)
    return uuid.UUID(int=(ms << 80) | (0x7 << 76) | (random.getrandbits(12) << 64)
                     | (0b10 << 62) | random.getrandbits(62))


def celery_job(pg: psycopg.Connection, state: str, args: str, created: datetime | None = None,
               **cols: Any) -> uuid.UUID:
    """A Celery-shaped job: its arguments in the body and in the argsrepr header."""
    created = created or datetime.now(timezone.utc)
    return add_job(pg, state, id=uuid7_at(created), content_type="application/json",
                   body=f'[["{args}"], {{}}, {{}}]'.encode(),
                   headers=Jsonb({"argsrepr": f"('{args}',)", "kwargsrepr": "{}"}), **cols)


def shown(html: str) -> list[str]:
    return re.findall(r'<tr data-job="([^"]+)"', html)


# -- the jobs browser ----------------------------------------------------------------------------

def test_browse_by_queue_task_state_time_and_text(client: FlaskClient,
                                                  pg: psycopg.Connection) -> None:
    now = datetime.now(timezone.utc)
    old = celery_job(pg, "dead", "order 1", now - timedelta(days=2))
    new = celery_job(pg, "dead", "order 2", now - timedelta(minutes=5))
    other = celery_job(pg, "dead", "ORDER 3", now - timedelta(seconds=2), task="t.b")
    done = celery_job(pg, "completed", "order 4", now - timedelta(seconds=1), queue="q2")
    assert shown(client.get("/jobs").text) == [str(done), str(other), str(new), str(old)]
    assert shown(client.get("/jobs?state=dead&task=t.a").text) == [str(new), str(old)]
    assert shown(client.get("/jobs?queue=q2").text) == [str(done)]
    since = (now - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert shown(client.get(f"/jobs?state=dead&from={since}").text) == [str(other), str(new)]
    until = (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    assert shown(client.get(f"/jobs?to={until}").text) == [str(old)]
    # text: in argsrepr any case, in the body exactly
    assert shown(client.get("/jobs?text=order 3").text) == [str(other)]
    assert shown(client.get("/jobs?state=dead&text=ORDER 2").text) == [str(new)]
    assert shown(client.get("/jobs?text=50%25_off").text) == []  # % and _ are not wildcards
    page = client.get("/jobs?state=nonsense")
    assert "unknown state" in page.text


def test_browse_pages_and_windows(client: FlaskClient, app: Any,
                                  pg: psycopg.Connection) -> None:
    now = datetime.now(timezone.utc)
    ids = [celery_job(pg, "completed", f"n{i}", now - timedelta(seconds=100 - i))
           for i in range(7)]
    with app.extensions["pgbroker"].connection() as conn:
        ops = Operations(conn, actor="t", via="test")
        first = ops.browse(JobFilter(state="completed"), limit=3)
        assert [r["id"] for r in first.rows] == ids[:3:-1]
        second = ops.browse(JobFilter(state="completed"), before=first.older, limit=3)
        assert [r["id"] for r in second.rows] == ids[3:0:-1]
        last = ops.browse(JobFilter(state="completed"), before=second.older, limit=3)
        assert ([r["id"] for r in last.rows], last.older, last.complete) == ([ids[0]], None, True)
        # a filter that matches little looks through a window of jobs at a time, and says so
        rare = ops.browse(JobFilter(text="n0"), limit=3, scan=4)
        assert (rare.rows, rare.complete, rare.older) == ([], False, ids[3])
        assert rare.searched_to is not None
        found = ops.browse(JobFilter(text="n0"), before=rare.older, limit=3, scan=4)
        assert [r["id"] for r in found.rows] == [ids[0]] and found.complete
    html = client.get("/jobs?state=completed").text
    assert "Older »" not in html  # seven fit on one page


def test_bulk_actions_are_confirmed_with_their_count_and_audited(
        client: FlaskClient, pg: psycopg.Connection) -> None:
    dead = [celery_job(pg, "dead", f"customer 42 order {i}", last_error="boom")
            for i in range(3)]
    spared = celery_job(pg, "dead", "customer 7")
    pending = [celery_job(pg, "pending", "customer 42 mail"),
               celery_job(pg, "scheduled", "customer 42 later", run_at=datetime.now(
                   timezone.utc) + timedelta(hours=1))]
    running = celery_job(pg, "running", "customer 42 now")

    confirm = client.get("/jobs/bulk?action=retry&text=customer 42").text
    assert '<strong class="big">3</strong> job(s) to retry' in confirm
    assert "Retry 3 job(s)" in confirm
    token = csrf(client)
    response = client.post("/jobs/bulk", data={"action": "retry", "text": "customer 42",
                                               "csrf_token": token}, follow_redirects=True)
    assert "Retried 3 job(s)." in response.text
    states = dict(pg.execute("SELECT id, state FROM pgbroker.jobs").fetchall())
    assert [states[i] for i in dead] == ["pending"] * 3 and states[spared] == "dead"

    confirm = client.get("/jobs/bulk?action=cancel&text=customer 42").text
    assert '<strong class="big">5</strong>' in confirm  # the 3 retried + 2: not the running one
    client.post("/jobs/bulk", data={"action": "cancel", "text": "customer 42",
                                    "csrf_token": token})
    states = dict(pg.execute("SELECT id, state FROM pgbroker.jobs").fetchall())
    assert {states[i] for i in dead + pending} == {"cancelled"}
    assert states[running] == "running"

    client.post("/jobs/bulk", data={"action": "discard", "state": "dead", "csrf_token": token})
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE id = %s", (spared,)
                      ).fetchone() == (0,)

    bulks = pg.execute("SELECT id, action, detail FROM pgbroker.audit"
                       " WHERE action LIKE 'jobs.bulk_%%' ORDER BY id").fetchall()
    assert [(a, d["filter"], d["found"], d["done"]) for _, a, d in bulks] == [
        ("jobs.bulk_retry", {"text": "customer 42"}, 3, 3),
        ("jobs.bulk_cancel", {"text": "customer 42"}, 5, 5),
        ("jobs.bulk_discard", {"state": "dead"}, 1, 1)]
    per_job = pg.execute("SELECT action, count(*), min((detail ->> 'bulk')::bigint)"
                         " FROM pgbroker.audit WHERE action NOT LIKE 'jobs.bulk_%%'"
                         " GROUP BY action ORDER BY action").fetchall()
    assert per_job == [("dead.discard", 1, bulks[2][0]), ("dead.retry", 3, bulks[0][0]),
                       ("job.cancel", 5, bulks[1][0])]


def test_a_bulk_action_leaves_jobs_that_came_after_the_confirmation(
        client: FlaskClient, pg: psycopg.Connection) -> None:
    with client.application.extensions["pgbroker"].connection() as conn:
        ops = Operations(conn, actor="t", via="test")
        celery_job(pg, "pending", "a")
        assert ops.bulk("cancel", JobFilter(), batch_size=1) == 1
        assert ops.count_matching(JobFilter(), ["pending", "scheduled"]) == {
            "pending": 0, "scheduled": 0}


# -- a job's page --------------------------------------------------------------------------------

def test_a_jobs_page_shows_every_try_of_its_task(client: FlaskClient,
                                                 pg: psycopg.Connection) -> None:
    tries = [celery_job(pg, state, "x", task_id="celery-7", retries=n,
                        last_error=f"ConnectionError: try {n}" if n < 2 else None)
             for n, state in enumerate(["completed", "completed", "dead"])]
    client.post("/dead/retry", data={"id": tries[2], "csrf_token": csrf(client)})
    html = client.get(f"/jobs/{tries[0]}").text
    assert "Its tries (3)" in html
    for job_id in tries:
        assert str(job_id) in html
    assert "ConnectionError: try 1" in html
    assert "(this one)" in html and f'href="/jobs/{tries[2]}"' in html
    assert (f'ended by sending a Celery retry: the task goes on in\n  <a href="/jobs/{tries[1]}"'
            in html)
    assert "dead.retry" in html  # the audit rows of every try
    assert "<h2>Arguments</h2>" in html and "&#34;x&#34;" in html


def test_tries_that_sent_a_celery_retry_count_as_retried_not_completed(
        client: FlaskClient, pg: psycopg.Connection) -> None:
    """Rows as pgbroker._celery.endings and the acks leave them (two tries that sent a retry, the
    last
    one dead, and one plain completion): the overview, /metrics and the job page say retried."""
    tries = [celery_job(pg, state, "x", task_id="celery-8", retries=n, attempts=1,
                        retried_attempt=1 if n < 2 else None,
                        last_error=f"retried: Retry in 0s: try {n}" if n < 2 else "ValueError")
             for n, state in enumerate(["completed", "completed", "dead"])]
    celery_job(pg, "completed", "y", task_id="celery-9")
    html = client.get("/overview/live").text
    row = html[html.index('data-queue="q1"'):]
    cells = dict(re.findall(r'data-col="(\w+)">(?:<a [^>]*>)?([^<]*)<', row)[:9])
    assert (cells["completed"], cells["retried"], cells["dead"]) == ("1", "2", "1")
    metrics = client.get("/metrics", headers={"Authorization": "Bearer s3cret-token-0123"}).text
    assert 'pgbroker_jobs{queue="q1",state="retried",task="t.a"} 2.0' in metrics
    assert 'pgbroker_jobs{queue="q1",state="completed",task="t.a"} 1.0' in metrics
    page = client.get(f"/jobs/{tries[1]}").text
    assert "Retried: this try ended by sending a Celery retry" in page
    tries_table = page[page.index("Its tries (3)"):]
    assert tries_table.count(">retried</span>") == 2 and "retried: Retry in 0s: try 1" in page
    assert "What the states mean" in page and "did not run to its end" in page


# -- workers -------------------------------------------------------------------------------------

def test_the_workers_page_shows_each_consumer_and_what_it_runs(
        client: FlaskClient, pg: psycopg.Connection) -> None:
    alive, late, lost = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    for cid, host, age, queues in ((alive, "web-1", 1, ["q1"]), (late, "web-2", 15, ["q1"]),
                                   (lost, "web-3", 3600, ["q1"]),
                                   (uuid.uuid4(), "cli", 0, ["x.reply.celery.pidbox"])):
        pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues, heartbeat_at)"
                   " VALUES (%s, %s, 4242, %s, now() - make_interval(secs => %s))",
                   (cid, host, queues, age))
    busy = celery_job(pg, "running", "report 9", locked_by=alive,
                      locked_at=datetime.now(timezone.utc) - timedelta(seconds=90))
    orphan = celery_job(pg, "running", "orphan", locked_by=uuid.uuid4())
    revoked = celery_job(pg, "running", "revoked", locked_by=late,
                         revoked_at=datetime.now(timezone.utc))
    html = client.get("/workers").text
    section = html[html.index(f'data-consumer="{alive}"'):html.index(f'data-consumer="{late}"')]
    assert "● alive" in section and "web-1" in section and str(busy) in section
    assert "(&#39;report 9&#39;,)" in section and "1 min 30 s" in section
    assert "◐ late" in html and "○ lost" in html
    revoked_row = html[html.index(f'<tr data-job="{revoked}"'):]
    assert 'revoked</span>' in revoked_row[:revoked_row.index("</tr>")]
    owner_gone = html[html.index("owner gone"):]
    assert str(orphan) in owner_gone and str(busy) not in owner_gone
    assert "1 remote-control client(s)" in html
    assert client.get("/workers/live").status_code == 200


# -- beat ----------------------------------------------------------------------------------------

def test_beat_entries_enable_disable_and_run_now(client: FlaskClient,
                                                 pg: psycopg.Connection) -> None:
    Schedules(pg, actor="t", via="test").add("report", "app.report", 3600.0)
    html = client.get("/beat").text
    row = html[html.index('data-entry="report"'):]
    assert "● enabled" in row and "every 3600s" in row and "never" in row
    token = csrf(client)
    response = client.post("/beat/run", data={"name": "report", "csrf_token": token},
                           follow_redirects=True)
    assert "will run at beat&#39;s next tick" in response.text
    due, = pg.execute("SELECT next_occurrence <= now() FROM pgbroker.beat_schedule").fetchone()
    assert due
    client.post("/beat/disable", data={"name": "report", "csrf_token": token})
    assert "○ disabled" in client.get("/beat").text
    response = client.post("/beat/run", data={"name": "report", "csrf_token": token},
                           follow_redirects=True)
    assert "is disabled" in response.text
    client.post("/beat/enable", data={"name": "report", "csrf_token": token})
    actions = [a for a, in pg.execute("SELECT action FROM pgbroker.audit ORDER BY id")]
    assert actions == ["schedule.add", "schedule.run_now", "schedule.disable",
                       "schedule.enable"]


def test_paused_queues_are_listed_with_who_paused_them(client: FlaskClient,
                                                       pg: psycopg.Connection) -> None:
    client.post("/queues/pause", data={"queue": "q1", "csrf_token": csrf(client)})
    for path in ("/", "/beat"):
        html = client.get(path).text
        box = html[html.index('class="paused-box"'):]
        assert "queue <a href=\"/queues/q1\">q1</a>" in box and "by alice" in box
