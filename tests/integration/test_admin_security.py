"""The admin page under attack (issue 18): redirects off the site, sessions that outlive their
logout, password guessing, weak secrets, cookies over plain HTTP, a job with 10 MB of headers, and
a read-only login that tries to act. Against a real database, through Flask's test client.

(docs/security.md, section "The admin page", lists each case and its test.)
"""

from __future__ import annotations

import re

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.datastructures import Authorization
from werkzeug.test import TestResponse
from psycopg.types.json import Jsonb

from pgbroker.admin import create_app
from tests.support.admin import CREDS, csrf, csrf_of
from tests.support.db import add_job
from tests.support.processes import Run


def log_in(app: Flask, user: str = "alice", password: str = "correct horse",
           address: str = "127.0.0.1") -> FlaskClient:
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = address
    token = csrf_of(client.get("/login").text)
    response = client.post("/login", data={"user": user, "password": password,
                                           "csrf_token": token})
    assert response.status_code == 303, response.text
    return client


# -- open redirect -------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [
    "%2F%09%2Fevil.example%2F",      # "/\t/evil.example/": browsers drop the tab -> //evil
    "%2F%0A%2Fevil.example%2F",      # a newline: was a 500 (a header with a newline)
    "%2F%0D%2Fevil.example%2F",
    "%2F%5Cevil.example%2F",         # "/\evil.example/": a backslash is a slash
    "%20%2F%2Fevil.example%2F",      # a leading space is stripped
    "%01%2F%2Fevil.example",         # so is a leading control character
    "%2F%2F%2Fevil.example",
    "https%3A%2F%2Fevil.example%2F",
    "%2F%09%5C%09evil.example",
])
def test_login_never_redirects_off_site(app: Flask, target: str) -> None:
    client = app.test_client()
    token = csrf_of(client.get("/login").text)
    response = client.post(f"/login?next={target}",
                           data={"token": "s3cret-token-0123", "csrf_token": token})
    assert response.status_code == 303
    assert response.headers["Location"] == "/"


def test_login_keeps_a_local_next(app: Flask) -> None:
    client = app.test_client()
    token = csrf_of(client.get("/login").text)
    response = client.post("/login?next=%2Fjobs%3Fstate%3Ddead",
                           data={"token": "s3cret-token-0123", "csrf_token": token})
    assert response.headers["Location"] == "/jobs?state=dead"


def test_an_action_never_redirects_off_site(app: Flask) -> None:
    client = log_in(app)
    response = client.post("/queues/pause", data={"queue": "q1", "csrf_token": csrf(client),
                                                  "next": "/\t/evil.example/"})
    assert (response.status_code, response.headers["Location"]) == (303, "/")


# -- sessions ------------------------------------------------------------------------------------

def test_logout_ends_the_session_for_a_saved_cookie(app: Flask, pg: psycopg.Connection) -> None:
    client = log_in(app)
    token = csrf(client)
    saved = client.get_cookie("pgbroker_admin")
    assert saved is not None
    client.post("/logout", data={"csrf_token": token})

    thief = app.test_client()
    thief.set_cookie("pgbroker_admin", saved.value)
    assert thief.get("/").status_code == 302  # back to the login page
    assert thief.get("/overview/live", headers={"HX-Request": "1"}).status_code == 401
    response = thief.post("/queues/pause", data={"queue": "q1", "csrf_token": token})
    assert response.status_code == 401
    assert pg.execute("SELECT paused FROM pgbroker.queues").fetchone() == (False,)
    assert pg.execute("SELECT count(*) FROM pgbroker.admin_sessions").fetchone() == (0,)


def test_a_session_is_a_row_holding_only_a_hash(app: Flask, pg: psycopg.Connection) -> None:
    client = log_in(app)
    (key, actor, role), = pg.execute(
        "SELECT id, actor, role FROM pgbroker.admin_sessions").fetchall()
    assert (actor, role) == ("alice", "operator") and len(key) == 32
    # the cookie's session id is not stored: the row's key is its SHA-256
    assert bytes(key).hex() not in client.get_cookie("pgbroker_admin").value
    # expired: refused, as after a logout
    pg.execute("UPDATE pgbroker.admin_sessions SET expires_at = now() - interval '1 s'")
    assert client.get("/").status_code == 302


def test_secure_cookie_option(db_url: str) -> None:
    app = create_app(db_url, credentials=CREDS, secure_cookie=True)
    try:
        client = app.test_client()
        token = csrf_of(client.get("/login", base_url="https://localhost").text)
        response = client.post("/login", base_url="https://localhost",
                               data={"token": "s3cret-token-0123", "csrf_token": token})
        cookie = response.headers["Set-Cookie"]
        assert cookie.startswith("__Host-pgbroker_admin=")
        assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=Lax" in cookie
    finally:
        app.extensions["pgbroker"].close()


def test_secure_cookie_from_the_environment(db_url: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setenv("PGBROKER_ADMIN_SECURE_COOKIE", "1")
    app = create_app(db_url, credentials=CREDS)
    try:
        assert app.config["SESSION_COOKIE_SECURE"] is True
    finally:
        app.extensions["pgbroker"].close()


# -- guessing passwords --------------------------------------------------------------------------

def test_failed_logins_are_throttled(app: Flask) -> None:
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = "203.0.113.7"
    token = csrf_of(client.get("/login").text)
    statuses = [client.post("/login", data={"user": "alice", "password": f"guess {i}",
                                            "csrf_token": token}).status_code
                for i in range(300)]
    assert statuses[:10] == [401] * 10
    assert set(statuses[10:]) == {429}
    # while throttled, even the right password is refused (or guessing would go on)
    right = client.post("/login", data={"user": "alice", "password": "correct horse",
                                        "csrf_token": token})
    assert right.status_code == 429 and int(right.headers["Retry-After"]) >= 1
    assert "Too many failed logins" in right.text
    # another address is not held up by this one
    log_in(app, address="198.51.100.9")


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_wrong_metrics_credentials_share_the_login_throttle(app: Flask, scheme: str) -> None:
    """Issue 27, item 5: /metrics checks the same credentials as /login, so it is throttled as
    /login is (it was an unthrottled password oracle: 500 guesses, all 401, then 200)."""
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = "203.0.113.8"

    def scrape(secret: str) -> TestResponse:
        auth = ("alice", secret) if scheme == "basic" else Authorization("bearer", token=secret)
        return client.get("/metrics", auth=auth)

    statuses = [scrape(f"guess {i}").status_code for i in range(300)]
    assert statuses[:10] == [401] * 10
    assert set(statuses[10:]) == {429}
    right = scrape("correct horse" if scheme == "basic" else "s3cret-token-0123")
    assert right.status_code == 429 and int(right.headers["Retry-After"]) >= 1
    # one budget: the login form from that address waits too
    token = csrf_of(client.get("/login").text)
    assert client.post("/login", data={"user": "alice", "password": "correct horse",
                                       "csrf_token": token}).status_code == 429
    # another address is not held up by this one
    other = app.test_client()
    other.environ_base["REMOTE_ADDR"] = "198.51.100.10"
    assert other.get("/metrics", auth=("alice", "correct horse")).status_code == 200


# -- weak secrets --------------------------------------------------------------------------------


def test_serve_refuses_a_weak_token(cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_ADMIN_TOKEN", "x")
    code, _, err = cli("serve", "--port", "0")
    assert code == 2 and "PGBROKER_ADMIN_TOKEN is too weak" in err


# -- 10 MB of headers ----------------------------------------------------------------------------

def test_a_job_page_cuts_huge_headers_and_offers_them_whole(app: Flask, pg: psycopg.Connection
                                                           ) -> None:
    big = {"x-blob": "h" * (10 * 1024 * 1024)}
    job_id = add_job(pg, "dead", headers=Jsonb(big), body=b"b" * (200 * 1024))
    client = log_in(app)
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200
    assert len(page.data) < 400 * 1024  # the page, not 10 MB
    assert "Headers of 10.0 MB: the first 64.0 kB are shown" in page.text
    assert "cut: 204800 bytes in all" in page.text
    raw = client.get(f"/jobs/{job_id}/raw/headers")
    assert raw.status_code == 200 and "attachment" in raw.headers["Content-Disposition"]
    assert len(raw.data) > 10 * 1024 * 1024 and raw.json == big
    body = client.get(f"/jobs/{job_id}/raw/body")
    assert body.data == b"b" * (200 * 1024)


# -- the read-only role --------------------------------------------------------------------------

def test_a_viewer_sees_every_page_and_acts_on_nothing(app: Flask, pg: psycopg.Connection
                                                       ) -> None:
    dead = add_job(pg, "dead", last_error="ValueError: boom")
    pending = add_job(pg, "pending")
    viewer = log_in(app, "victor", "look but don't touch")
    for path in ("/", "/overview/live", "/charts", "/queues/q1", "/workers", "/workers/live",
                 "/jobs", f"/jobs/{dead}", "/dead", "/beat", "/audit"):
        response = viewer.get(path)
        assert response.status_code == 200, path
        assert not re.search(r'<form[^>]+method="post"[^>]+action="/(?!logout)', response.text
                             ), f"an action form on {path}"
    assert "read-only" in viewer.get("/").text
    token = csrf(viewer)
    for path, data in (("/queues/pause", {"queue": "q1"}), ("/dead/retry", {"id": dead}),
                       ("/dead/discard", {"id": dead}), ("/jobs/cancel", {"id": pending}),
                       ("/dead/retry-all", {}), ("/jobs/bulk", {"action": "retry"}),
                       ("/beat/run", {"name": "x"})):
        response = viewer.post(path, data={**data, "csrf_token": token})
        assert response.status_code == 403, path
    assert dict(pg.execute("SELECT id, state FROM pgbroker.jobs").fetchall()) == {
        dead: "dead", pending: "pending"}
    assert pg.execute("SELECT paused FROM pgbroker.queues").fetchone() == (False,)
    assert pg.execute("SELECT count(*) FROM pgbroker.audit").fetchone() == (0,)
    viewer.post("/logout", data={"csrf_token": token})  # logging out is not an action
    assert viewer.get("/").status_code == 302


def test_the_viewer_token_scrapes_metrics(app: Flask) -> None:
    response = app.test_client().get("/metrics",
                                     headers={"Authorization": "Bearer viewer-token-4567"})
    assert response.status_code == 200 and "pgbroker_up 1.0" in response.text


# -- a thousand idle queues ----------------------------------------------------------------------

def test_idle_queues_are_counted_not_listed_in_the_live_overview(app: Flask,
                                                                 pg: psycopg.Connection) -> None:
    pg.execute("INSERT INTO pgbroker.queues (name) SELECT 'idle-' || i || repeat('x', 200)"
               " FROM generate_series(1, 1000) AS i")
    add_job(pg, "pending")
    client = log_in(app)
    live = client.get("/overview/live")
    assert len(live.data) < 30 * 1024  # was 1.1 MB for 1,000 queues, every --refresh seconds
    assert '<tr data-queue="q1"' in live.text
    assert "1000 idle queue(s), with no job in the window and no consumer, not listed" in live.text
    everything = client.get("/overview/live?all=1").text
    assert everything.count('<tr data-queue="idle-') == 1000
