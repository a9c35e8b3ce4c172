"""The admin web app (Flask): queues overview, dead letters, job look-up, audit log, /metrics.

Server-rendered Jinja2 pages (autoescaped: no job payload, task name or error is ever rendered
as markup) with htmx refreshing the overview; every action is a plain POST form that goes through
:class:`pgbroker.ops.Operations`, the same code as the CLI, with the logged-in user as the actor.
Requests borrow a connection from a small psycopg pool for their duration.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from flask import (
    Flask,
    Response,
    abort,
    flash,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from psycopg_pool import ConnectionPool

from .. import _db
from ..errors import DatabaseUnavailable
from ..metrics import MetricsReader, Snapshot, prometheus_registry
from ..migrate import check as check_schema
from ..ops import JOB_STATES, OperationError, Operations, body_text, is_poison
from ..settings import Settings
from .auth import ENV_SECRET, Credentials, new_csrf_token, same_secret

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

#: Endpoints open without a login.
_PUBLIC = frozenset({"login", "static", "favicon"})


@dataclass
class AdminState:
    """What the app's views share; ``app.extensions["pgbroker"]``."""

    pool: ConnectionPool
    schema: str
    credentials: Credentials
    reader: MetricsReader
    refresh: float
    registry: Any

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self.pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"admin page: {exc}") from exc

    def snapshot(self) -> Snapshot:
        with self.connection() as conn:
            return self.reader.snapshot(conn)

    def close(self) -> None:
        self.pool.close()


def _state() -> AdminState:
    from flask import current_app

    return current_app.extensions["pgbroker"]  # type: ignore[no-any-return]


@contextmanager
def _ops() -> Iterator[Operations]:
    with _state().connection() as conn:
        yield Operations(conn, _state().schema, actor=session["user"], via="admin")


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SET TIME ZONE 'UTC'")  # as every pgbroker connection (pgbroker._db.connect)


def _local(target: str | None, default: str) -> str:
    """A redirect target on this site only (no open redirect through ``next``)."""
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return default


def _back(default: str = "/") -> Response:
    return redirect(_local(request.form.get("next"), default), code=303)


def create_app(database_url: str, schema: str = "pgbroker", credentials: Credentials | None = None,
               *, refresh: float = 3.0, window: float | None = None,
               lease_timeout: float | None = None, secret_key: str | bytes | None = None,
               pool_size: int = 4) -> Flask:
    """The admin app for ``schema`` in ``database_url``; checks the schema first.

    Call ``app.extensions["pgbroker"].close()`` when done (``serve`` does).
    """
    credentials = credentials or Credentials.from_env()
    if not credentials.configured:
        raise ValueError("the admin page needs credentials (see pgbroker.admin.auth)")
    Settings(schema=schema)
    conninfo = _db.libpq_url(database_url)
    conn = _db.connect(conninfo, application_name="pgbroker admin")
    try:
        with _db.translate_errors("checking the pgbroker schema"):
            check_schema(conn, schema)
    finally:
        _db.close(conn)

    app = Flask(__name__)
    app.config.update(
        SECRET_KEY=secret_key or os.environ.get(ENV_SECRET) or secrets.token_bytes(32),
        SESSION_COOKIE_NAME="pgbroker_admin",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        PERMANENT_SESSION_LIFETIME=timedelta(hours=8),
        MAX_CONTENT_LENGTH=64 * 1024,
    )
    pool = ConnectionPool(conninfo, min_size=1, max_size=pool_size, timeout=10,
                          name="pgbroker-admin", open=True,
                          kwargs={"autocommit": True, **_db.connect_kwargs("pgbroker admin")},
                          configure=_configure)
    reader = MetricsReader(schema, window=window, lease_timeout=lease_timeout)
    state = AdminState(pool, schema, credentials, reader, refresh, None)
    state.registry = prometheus_registry(state.snapshot)
    app.extensions["pgbroker"] = state
    _install_guards(app)
    _install_filters(app)
    _install_views(app)
    return app


# -- authentication and CSRF ---------------------------------------------------------------------

def _scraper_allowed(creds: Credentials) -> bool:
    auth = request.authorization
    if auth is None:
        return False
    if auth.type == "bearer":
        return same_secret(auth.token, creds.token)
    return creds.login(auth.username, auth.password, None) is not None


def _install_guards(app: Flask) -> None:
    @app.before_request
    def guard() -> Any:
        creds = _state().credentials
        endpoint = request.endpoint
        if endpoint not in _PUBLIC and not session.get("user"):
            if endpoint == "metrics" and _scraper_allowed(creds):
                return None
            if request.method == "GET" and endpoint != "metrics" and \
                    "HX-Request" not in request.headers:
                return redirect(url_for("login", next=request.full_path.rstrip("?")))
            return Response("authentication required\n", 401, mimetype="text/plain",
                            headers={"WWW-Authenticate": 'Basic realm="pgbroker"'})
        if request.method == "POST":
            expected = session.get("csrf")
            if not same_secret(request.form.get("csrf_token"), expected):
                logger.warning("pgbroker admin: refused a POST to %s without a valid CSRF token",
                               request.path)
                abort(400, description="CSRF token missing or invalid: reload the page and "
                                       "try again")
        return None

    @app.after_request
    def headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy",
                                    "default-src 'self'; frame-ancestors 'none'; "
                                    "form-action 'self'; base-uri 'none'")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.context_processor
    def csrf() -> dict[str, Callable[[], str]]:
        def token() -> str:
            if "csrf" not in session:
                session["csrf"] = new_csrf_token()
            return str(session["csrf"])

        return {"csrf_token": token}

    @app.errorhandler(DatabaseUnavailable)
    def unavailable(exc: DatabaseUnavailable) -> tuple[str, int]:
        logger.warning("pgbroker admin: %s", exc)
        if "HX-Request" in request.headers:  # the live overview: a line in place of the table
            return render_template("_unavailable.html", message=str(exc)), 503
        return render_template("error.html", message=str(exc)), 503


# -- template filters ----------------------------------------------------------------------------

def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    size, unit, sub_size, sub = ((60, "min", 1, "s") if s < 3600 else
                                 (3600, "h", 60, "min") if s < 86400 else (86400, "d", 3600, "h"))
    rest = s % size // sub_size
    return f"{s // size} {unit}" + (f" {rest} {sub}" if rest else "")


def _install_filters(app: Flask) -> None:
    app.add_template_filter(_duration, "duration")
    app.add_template_filter(lambda v: v.strftime("%Y-%m-%d %H:%M:%S") if v else "–", "when")
    app.add_template_filter(
        lambda t: (t or "").strip().splitlines()[0] if (t or "").strip() else "", "first_line")
    app.add_template_global(is_poison, "is_poison")


# -- views ---------------------------------------------------------------------------------------

def _install_views(app: Flask) -> None:  # noqa: C901 - one small function per route
    @app.route("/login", methods=["GET", "POST"])
    def login() -> Any:
        creds = _state().credentials
        if request.method == "POST":
            actor = creds.login(request.form.get("user"), request.form.get("password"),
                                request.form.get("token"))
            if actor is None:
                flash("Wrong user, password or token.", "error")
                logger.warning("pgbroker admin: failed login from %s", request.remote_addr)
                return render_template("login.html", creds=creds), 401
            session.clear()  # a fresh session (and CSRF token) at login: no fixation
            session.permanent = True
            session["user"] = actor
            session["csrf"] = new_csrf_token()
            logger.info("pgbroker admin: %s logged in", actor)
            return redirect(_local(request.args.get("next"), url_for("overview")), code=303)
        return render_template("login.html", creds=creds)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status=204)  # none: but no 404 in every browser console

    @app.post("/logout")
    def logout() -> Any:
        session.clear()
        return redirect(url_for("login"), code=303)

    @app.get("/")
    def overview() -> Any:
        return render_template("overview.html", snap=_state().snapshot(),
                               refresh=_state().refresh)

    @app.get("/overview/live")
    def overview_live() -> Any:
        return render_template("_overview.html", snap=_state().snapshot())

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(_state().registry), mimetype=CONTENT_TYPE_LATEST)

    @app.get("/dead")
    def dead() -> Any:
        queue = request.args.get("queue") or None
        with _ops() as ops:
            rows = ops.dead(queue, limit=200)
        return render_template("dead.html", rows=rows, queue=queue)

    @app.get("/jobs")
    def jobs() -> Any:
        q = request.args.get("q", "").strip()
        state = request.args.get("state") or None
        queue = request.args.get("queue") or None
        with _ops() as ops:
            try:
                rows = ops.lookup(q) if q else ops.jobs(queue, state, None, 100)
            except OperationError as exc:
                flash(str(exc), "error")
                rows = []
        if q and len(rows) == 1:
            return redirect(url_for("job", job_id=rows[0]["id"]), code=303)
        return render_template("jobs.html", rows=rows, q=q, state=state, queue=queue,
                               states=JOB_STATES)

    @app.get("/jobs/<job_id>")
    def job(job_id: str) -> Any:
        with _ops() as ops:
            try:
                row = ops.job(job_id)
            except OperationError as exc:
                return render_template("error.html", message=str(exc)), 404
            history = ops.audit(str(row["id"]), 50)
        body = body_text(row.pop("body"), row["content_type"])
        return render_template("job.html", job=row, body=body, history=history)

    @app.get("/audit")
    def audit() -> Any:
        with _ops() as ops:
            rows = ops.audit(request.args.get("target") or None, 200)
        return render_template("audit.html", rows=rows)

    def action(path: str, run: Callable[[Operations], str], default: str = "/") -> None:
        def view() -> Response:
            with _ops() as ops:
                try:
                    flash(run(ops), "ok")
                except OperationError as exc:
                    flash(str(exc), "error")
            return _back(default)

        app.add_url_rule(path, path.strip("/").replace("/", "_").replace("-", "_"), view,
                         methods=["POST"])

    def form(name: str) -> str:
        return request.form.get(name, "").strip()

    def retry(ops: Operations) -> str:
        ops.retry_dead(form("id"))
        return f"Retried job {form('id')}: it is pending again."

    def discard(ops: Operations) -> str:
        ops.discard_dead(form("id"))
        return f"Discarded dead job {form('id')}."

    def retry_all(ops: Operations) -> str:
        return f"Retried {ops.retry_all_dead(form('queue') or None)} dead job(s)."

    def discard_all(ops: Operations) -> str:
        if form("confirm") != "yes":
            raise OperationError("Tick “delete them all” to discard every dead job.")
        return f"Discarded {ops.discard_all_dead(form('queue') or None)} dead job(s)."

    def cancel(ops: Operations) -> str:
        ops.cancel(form("id"))
        return f"Cancelled job {form('id')}."

    def pause(ops: Operations) -> str:
        changed = ops.pause(form("queue"))
        return f"Queue {form('queue')} {'paused' if changed else 'was already paused'}."

    def resume(ops: Operations) -> str:
        changed = ops.resume(form("queue"))
        return f"Queue {form('queue')} {'resumed' if changed else 'was not paused'}."

    action("/dead/retry", retry, "/dead")
    action("/dead/discard", discard, "/dead")
    action("/dead/retry-all", retry_all, "/dead")
    action("/dead/discard-all", discard_all, "/dead")
    action("/jobs/cancel", cancel)
    action("/queues/pause", pause)
    action("/queues/resume", resume)

    @app.context_processor
    def user() -> dict[str, Any]:
        return {"user": session.get("user")}
