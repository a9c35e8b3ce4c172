"""The admin app over a real database, through Flask's test client: authentication, CSRF,
escaping of everything a job carries, the actions and their audit rows, /metrics.

(The same pages in a real browser, with a real worker: tests/e2e/test_admin_browser.py.)
"""

from __future__ import annotations

import base64
import re
import uuid

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from psycopg.types.json import Jsonb

from pgbroker.admin import create_app
from pgbroker.admin.auth import Credentials
from pgbroker.errors import SchemaError
from tests.support.admin import CREDS, csrf, csrf_of
from tests.support.db import LOST, add_job

XSS = "<script>alert('pwned')</script>"


# -- authentication ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/", "/dead", "/jobs", "/audit", "/overview/live",
                                  "/jobs/0190a6e2-57c1-7b3e-9a55-3f2d1c0b9e41"])
def test_pages_need_a_login(app: Flask, path: str) -> None:
    response = app.test_client().get(path)
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/login?next=")


def test_live_updates_and_actions_without_login_are_401(app: Flask, pg: psycopg.Connection
                                                        ) -> None:
    client = app.test_client()
    assert client.get("/overview/live", headers={"HX-Request": "true"}).status_code == 401
    assert client.post("/queues/pause", data={"queue": "q1"}).status_code == 401
    assert pg.execute("SELECT paused FROM pgbroker.queues").fetchone() == (False,)


def test_login_with_password_or_token_and_logout(app: Flask) -> None:
    client = app.test_client()
    token = csrf_of(client.get("/login").text)
    bad = client.post("/login", data={"user": "alice", "password": "wrong", "csrf_token": token})
    assert bad.status_code == 401 and "Wrong user, password or token" in bad.text
    assert client.get("/").status_code == 302
    ok = client.post("/login?next=/dead", data={"token": "s3cret-token-0123", "csrf_token": token})
    assert (ok.status_code, ok.headers["Location"]) == (303, "/dead")
    assert client.get("/").status_code == 200
    client.post("/logout", data={"csrf_token": csrf(client)})
    assert client.get("/").status_code == 302


def test_login_without_csrf_token_is_refused(app: Flask) -> None:
    client = app.test_client()
    client.get("/login")
    response = client.post("/login", data={"user": "alice", "password": "correct horse"})
    assert response.status_code == 400
    assert client.get("/").status_code == 302


def test_metrics_need_credentials(app: Flask) -> None:
    client = app.test_client()
    assert client.get("/metrics").status_code == 401
    bearer = client.get("/metrics", headers={"Authorization": "Bearer s3cret-token-0123"})
    assert bearer.status_code == 200 and "pgbroker_up 1.0" in bearer.text
    basic = base64.b64encode(b"alice:correct horse").decode()
    assert client.get("/metrics", headers={"Authorization": f"Basic {basic}"}).status_code == 200
    wrong = base64.b64encode(b"alice:nope").decode()
    assert client.get("/metrics", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_basic_credentials_do_not_authorise_form_actions(app: Flask, pg: psycopg.Connection
                                                         ) -> None:
    basic = base64.b64encode(b"alice:correct horse").decode()
    response = app.test_client().post("/queues/pause", data={"queue": "q1"},
                                      headers={"Authorization": f"Basic {basic}"})
    assert response.status_code == 401
    assert pg.execute("SELECT paused FROM pgbroker.queues").fetchone() == (False,)


def test_create_app_refuses_missing_credentials_and_schema(db_url: str) -> None:
    with pytest.raises(ValueError, match="needs credentials"):
        create_app(db_url, credentials=Credentials())
    with pytest.raises(SchemaError, match="pgbroker migrate"):
        create_app(db_url, "nothere", credentials=CREDS)


# -- CSRF ----------------------------------------------------------------------------------------

def test_form_actions_need_the_sessions_csrf_token(client: FlaskClient, pg: psycopg.Connection
                                                   ) -> None:
    for data in ({"queue": "q1"}, {"queue": "q1", "csrf_token": "forged"},
                 {"queue": "q1", "csrf_token": ""}):
        response = client.post("/queues/pause", data=data)
        assert response.status_code == 400 and "CSRF token missing or invalid" in response.text
    assert pg.execute("SELECT paused FROM pgbroker.queues").fetchone() == (False,)
    assert pg.execute("SELECT count(*) FROM pgbroker.audit").fetchone() == (0,)

    # another session's token is refused too
    other = client.application.test_client()
    other_token = csrf_of(other.get("/login").text)
    assert client.post("/queues/pause", data={"queue": "q1", "csrf_token": other_token}
                       ).status_code == 400

    response = client.post("/queues/pause", data={"queue": "q1", "csrf_token": csrf(client)})
    assert response.status_code == 303
    assert pg.execute("SELECT paused FROM pgbroker.queues").fetchone() == (True,)
    assert pg.execute("SELECT actor, action, target, detail ->> 'via' FROM pgbroker.audit"
                      ).fetchall() == [("alice", "queue.pause", "q1", "admin")]


# -- escaping ------------------------------------------------------------------------------------

def test_nothing_a_job_carries_is_rendered_as_markup(client: FlaskClient,
                                                     pg: psycopg.Connection) -> None:
    pg.execute("INSERT INTO pgbroker.queues (name) VALUES (%s)", (XSS,))
    job_id = add_job(pg, "dead", queue=XSS, task=XSS, last_error=XSS,
                     last_traceback=XSS, idempotency_key=XSS, content_type="application/json",
                     body=f'[["{XSS}"], {{}}, {{}}]'.encode(), headers=Jsonb({"x": XSS}))
    pages = ["/", "/overview/live", "/dead", f"/jobs/{job_id}", "/jobs"]
    for path in pages:
        html = client.get(path).text
        assert "<script>alert" not in html, path
        assert "&lt;script&gt;alert(" in html or "\\u003cscript\\u003e" in html, path
    html = client.get(f"/jobs/{job_id}").text
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in html
    assert "Content-Security-Policy" in client.get("/").headers


# -- pages and actions ---------------------------------------------------------------------------

def test_dead_letters_page_shows_poison_distinctly(client: FlaskClient, pg: psycopg.Connection
                                                   ) -> None:
    poison = add_job(pg, "dead", last_error=LOST)
    plain = add_job(pg, "dead", last_error="ValueError: boom",
                    last_traceback="Traceback (most recent call last):\n  File x")
    html = client.get("/dead").text
    by_job = {job: cls for cls, job in re.findall(r'<tr class="([^"]*)" data-job="([^"]+)"',
                                                  html)}
    assert by_job == {str(poison): "poison", str(plain): ""}
    assert html.count("poison: killed its worker on every attempt") == 1
    assert "Traceback (most recent call last)" in html and "ValueError: boom" in html


def test_retry_discard_and_cancel_from_the_page(client: FlaskClient, pg: psycopg.Connection
                                                ) -> None:
    dead = add_job(pg, "dead", last_error="ValueError: boom")
    doomed = add_job(pg, "dead")
    pending = add_job(pg, "pending")
    token = csrf(client)
    response = client.post("/dead/retry", data={"id": str(dead), "csrf_token": token,
                                                 "next": "/dead"}, follow_redirects=True)
    assert f"Retried job {dead}" in response.text
    client.post("/dead/discard", data={"id": str(doomed), "csrf_token": token})
    client.post("/jobs/cancel", data={"id": str(pending), "csrf_token": token})
    states = dict(pg.execute("SELECT id, state FROM pgbroker.jobs").fetchall())
    assert states == {dead: "pending", pending: "cancelled"}
    actions = pg.execute("SELECT actor, action, target FROM pgbroker.audit ORDER BY id").fetchall()
    assert actions == [("alice", "dead.retry", str(dead)), ("alice", "dead.discard", str(doomed)),
                       ("alice", "job.cancel", str(pending))]
    # a mistake is a message, not an error page: the job is not dead any more
    response = client.post("/dead/retry", data={"id": str(dead), "csrf_token": token},
                           follow_redirects=True)
    assert "is pending: only dead jobs can be retried" in response.text
    history = client.get(f"/jobs/{dead}").text
    assert "dead.retry" in history and "ValueError: boom" in history


def test_retry_all_and_pause_resume(client: FlaskClient, pg: psycopg.Connection) -> None:
    for _ in range(3):
        add_job(pg, "dead")
    token = csrf(client)
    response = client.post("/dead/retry-all", data={"queue": "q1", "csrf_token": token},
                           follow_redirects=True)
    assert "Retried 3 dead job(s)." in response.text
    client.post("/queues/pause", data={"queue": "q1", "csrf_token": token})
    assert 'class="badge paused-badge"' in client.get("/overview/live").text
    response = client.post("/queues/resume", data={"queue": "q1", "csrf_token": token},
                           follow_redirects=True)
    assert "Queue q1 resumed." in response.text
    response = client.post("/queues/pause", data={"queue": "nope", "csrf_token": token},
                           follow_redirects=True)
    assert "unknown queue &#39;nope&#39;" in response.text


def test_look_up_by_id_task_id_or_key(client: FlaskClient, pg: psycopg.Connection) -> None:
    job_id = add_job(pg, "pending", task_id="celery-id-1", idempotency_key="order-7")
    for key in (str(job_id), "celery-id-1", "order-7"):
        response = client.get("/jobs", query_string={"q": key})
        assert response.headers["Location"] == f"/jobs/{job_id}", key
    assert "No job found." in client.get("/jobs", query_string={"q": "nothing"}).text
    assert client.get("/jobs/not-a-uuid").status_code == 404
    assert client.get(f"/jobs/{uuid.uuid4()}").status_code == 404


def test_overview_numbers(client: FlaskClient, pg: psycopg.Connection) -> None:
    for state in ("pending", "pending", "running", "dead"):
        add_job(pg, state)
    html = client.get("/overview/live").text
    row = html[html.index('data-queue="q1"'):]
    cells = dict(re.findall(r'data-col="(\w+)">(?:<a [^>]*>)?([^<]*)<', row)[:6])
    assert (cells["pending"], cells["running"], cells["dead"]) == ("2", "1", "1")


def test_discard_all_needs_the_tick(client: FlaskClient, pg: psycopg.Connection) -> None:
    for _ in range(2):
        add_job(pg, "dead")
    token = csrf(client)
    response = client.post("/dead/discard-all", data={"csrf_token": token},
                           follow_redirects=True)
    assert "to discard every dead job" in response.text
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone() == (2,)
    response = client.post("/dead/discard-all", data={"csrf_token": token, "confirm": "yes"},
                           follow_redirects=True)
    assert "Discarded 2 dead job(s)." in response.text
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone() == (0,)


def test_an_unreachable_database_is_a_503_page(client: FlaskClient, pg: psycopg.Connection
                                               ) -> None:
    client.application.extensions["pgbroker"].pool.close()  # as if the database went away
    response = client.get("/")
    assert response.status_code == 503 and "<h1>Error</h1>" in response.text
    live = client.get("/overview/live", headers={"HX-Request": "true"})
    assert live.status_code == 503 and "cannot be read right now" in live.text
