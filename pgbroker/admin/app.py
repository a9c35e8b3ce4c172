"""The admin web app (Flask): overview with live charts, queues, workers, jobs browser with bulk
actions, a job's whole history, dead letters, beat, audit log, /metrics.

Server-rendered Jinja2 pages (autoescaped: no job payload, task name or error is ever rendered
as markup), charts drawn as inline SVG on the server (:mod:`.charts`), htmx polling the parts
that change; every action is a plain POST form that goes through :class:`pgbroker.ops.Operations`
(or :class:`pgbroker.beat.Schedules`), the same code as the CLI, with the logged-in user as the
actor. Requests borrow a connection from a small psycopg pool for their duration.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import psycopg
from flask import (
    Flask,
    Response,
    abort,
    flash,
    g,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from .. import _db
from .._sql import queries
from ..beat import Schedules
from ..errors import DatabaseUnavailable
from ..metrics import MetricsReader, Snapshot, is_internal_queue, prometheus_registry
from ..migrate import check as check_schema
from ..ops import (
    BULK_ACTIONS,
    JOB_STATES,
    SMALL_STATES,
    JobFilter,
    OperationError,
    Operations,
    body_text,
    is_poison,
    parse_job_id,
)
from ..settings import Settings
from . import charts, stats
from .auth import (
    ENV_SECRET,
    ENV_SECURE_COOKIE,
    Credentials,
    Login,
    LoginThrottle,
    close_session,
    find_session,
    new_csrf_token,
    open_session,
    same_secret,
)

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

#: Endpoints open without a login.
_PUBLIC = frozenset({"login", "static", "favicon"})

#: Characters of headers, properties and body shown on a job's page (the rest: download).
PAGE_LIMIT = 65536


@dataclass
class AdminState:
    """What the app's views share; ``app.extensions["pgbroker"]``."""

    pool: ConnectionPool
    schema: str
    credentials: Credentials
    reader: MetricsReader
    refresh: float
    registry: Any
    throttle: LoginThrottle
    q: dict[str, str]
    lease_timeout: float
    heartbeat_interval: float

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self.pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"admin page: {exc}") from exc

    def rows(self, name: str, **params: Any) -> list[dict[str, Any]]:
        with self.connection() as conn, _db.translate_errors(f"pgbroker {name}"):
            return conn.cursor(row_factory=dict_row).execute(self.q[name], params).fetchall()

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
        yield Operations(conn, _state().schema, actor=g.login.actor, via="admin")


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SET TIME ZONE 'UTC'")  # as every pgbroker connection (pgbroker._db.connect)
    # Short reads over partial indexes: JIT compiling (its cost model counts rows the indexes
    # never read) took longer than the queries.
    conn.execute("SET jit = off")


_URL_NOISE = re.compile(r"[\t\n\r]")
_C0_AND_SPACE = "".join(map(chr, range(0x21)))


def _local(target: str | None, default: str) -> str:
    """A redirect target on this site only, judged as a browser reads it: browsers drop tabs
    and newlines anywhere in a URL, strip control characters and spaces around it and take a
    backslash for a slash, so ``/\\t/evil.example`` is ``//evil.example``, another site."""
    if not target:
        return default
    cleaned = _URL_NOISE.sub("", target).strip(_C0_AND_SPACE)
    if (not cleaned.startswith("/") or cleaned[1:2] in ("/", "\\") or "\\" in cleaned
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in cleaned)):
        return default
    parts = urlsplit(cleaned)
    if parts.scheme or parts.netloc:
        return default
    return cleaned


def _back(default: str = "/") -> Response:
    return redirect(_local(request.form.get("next"), default), code=303)


def create_app(database_url: str, schema: str = "pgbroker", credentials: Credentials | None = None,
               *, refresh: float = 3.0, window: float | None = None,
               lease_timeout: float | None = None, secret_key: str | bytes | None = None,
               pool_size: int = 4, secure_cookie: bool | None = None,
               throttle: LoginThrottle | None = None) -> Flask:
    """The admin app for ``schema`` in ``database_url``; checks the schema first.

    ``secure_cookie``: send the session cookie over HTTPS only (default:
    ``PGBROKER_ADMIN_SECURE_COOKIE``). Call ``app.extensions["pgbroker"].close()`` when done
    (``serve`` does).
    """
    credentials = credentials or Credentials.from_env()
    if not credentials.configured:
        raise ValueError("the admin page needs credentials (see pgbroker.admin.auth)")
    settings = Settings(schema=schema)
    conninfo = _db.libpq_url(database_url)
    conn = _db.connect(conninfo, application_name="pgbroker admin")
    try:
        with _db.translate_errors("checking the pgbroker schema"):
            check_schema(conn, schema)
    finally:
        _db.close(conn)
    if secure_cookie is None:
        secure_cookie = os.environ.get(ENV_SECURE_COOKIE, "").lower() in ("1", "true", "yes")

    app = Flask(__name__)
    app.config.update(
        SECRET_KEY=secret_key or os.environ.get(ENV_SECRET) or secrets.token_bytes(32),
        # __Host-: a cookie the browser keeps only from HTTPS, for this host, for every path
        SESSION_COOKIE_NAME="__Host-pgbroker_admin" if secure_cookie else "pgbroker_admin",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=secure_cookie,
        MAX_CONTENT_LENGTH=64 * 1024,
    )
    # prepare_threshold None: every statement is planned with its values, so a state or queue
    # given as a parameter still picks its partial index (a generic plan cannot).
    pool = ConnectionPool(conninfo, min_size=1, max_size=pool_size, timeout=10,
                          name="pgbroker-admin", open=True,
                          kwargs={"autocommit": True, "prepare_threshold": None,
                                  **_db.connect_kwargs("pgbroker admin")},
                          configure=_configure)
    reader = MetricsReader(schema, window=window, lease_timeout=lease_timeout)
    state = AdminState(pool, schema, credentials, reader, refresh, None,
                       throttle or LoginThrottle(), queries(schema), reader.lease_timeout,
                       settings.heartbeat_interval)
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
        return creds.login(None, None, auth.token) is not None
    return creds.login(auth.username, auth.password, None) is not None


def _install_guards(app: Flask) -> None:
    @app.before_request
    def guard() -> Any:
        state = _state()
        endpoint = request.endpoint
        g.login, g.csrf = None, None
        sid = session.get("sid")
        if endpoint not in _PUBLIC and sid:
            with state.connection() as conn:
                found = find_session(conn, state.q, sid)
            if found is not None:
                g.login, g.csrf = found.login, found.csrf
            else:
                session.pop("sid", None)  # logged out, or expired
        if endpoint not in _PUBLIC and g.login is None:
            if endpoint == "metrics" and _scraper_allowed(state.credentials):
                return None
            if request.method == "GET" and endpoint != "metrics" and \
                    "HX-Request" not in request.headers:
                return redirect(url_for("login", next=request.full_path.rstrip("?")))
            return Response("authentication required\n", 401, mimetype="text/plain",
                            headers={"WWW-Authenticate": 'Basic realm="pgbroker"'})
        if request.method == "POST":
            expected = g.csrf if g.login is not None else session.get("csrf")
            if not same_secret(request.form.get("csrf_token"), expected):
                logger.warning("pgbroker admin: refused a POST to %s without a valid CSRF token",
                               request.path)
                abort(400, description="CSRF token missing or invalid: reload the page and "
                                       "try again")
            if g.login is not None and not g.login.can_act and endpoint != "logout":
                logger.warning("pgbroker admin: refused a POST to %s by %s (read-only)",
                               request.path, g.login.actor)
                abort(403, description="read-only: this login can look, not act")
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
    def csrf() -> dict[str, Any]:
        def token() -> str:
            if g.get("csrf"):
                return str(g.csrf)
            if "csrf" not in session:
                session["csrf"] = new_csrf_token()
            return str(session["csrf"])

        login: Login | None = g.get("login")
        return {"csrf_token": token, "login": login, "user": login.actor if login else None,
                "can_act": bool(login and login.can_act)}

    @app.errorhandler(DatabaseUnavailable)
    def unavailable(exc: DatabaseUnavailable) -> tuple[str, int]:
        logger.warning("pgbroker admin: %s", exc)
        if "HX-Request" in request.headers:  # a live part: a line in its place
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


def _size(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _install_filters(app: Flask) -> None:
    app.add_template_filter(_duration, "duration")
    app.add_template_filter(_size, "size")
    app.add_template_filter(lambda v: v.strftime("%Y-%m-%d %H:%M:%S") if v else "–", "when")
    app.add_template_filter(
        lambda t: (t or "").strip().splitlines()[0] if (t or "").strip() else "", "first_line")
    app.add_template_filter(charts.format_ms, "ms")
    app.add_template_filter(lambda d, *keys: {k: v for k, v in d.items() if k not in keys},
                            "dict_without")
    app.add_template_filter(charts.format_count, "count")
    app.add_template_global(is_poison, "is_poison")
    app.add_template_global(is_internal_queue, "is_internal_queue")


# -- helpers of the views ------------------------------------------------------------------------

def _when(name: str, source: Any = None) -> datetime | None:
    """A ``datetime-local`` field (of the query string by default), read as UTC."""
    text = ((request.args if source is None else source).get(name) or "").strip()
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)
    except ValueError:
        raise OperationError(f"{name}: {text!r} is not a date and time (YYYY-MM-DDTHH:MM)") \
            from None


def _job_filter(source: Any) -> JobFilter:
    """The jobs browser's filter from its form fields (a query string or a POSTed form)."""
    def field(name: str) -> str | None:
        return (source.get(name) or "").strip() or None

    return JobFilter(queue=field("queue"), task=field("task"), state=field("state"),
                     created_from=_when("from", source), created_to=_when("to", source),
                     text=source.get("text") or None)


def _filter_args(match: JobFilter) -> dict[str, str]:
    """The query string of a filter (the browser's form fields)."""
    return {k: v for k, v in {
        "queue": match.queue, "task": match.task, "state": match.state, "text": match.text,
        "from": match.created_from.strftime("%Y-%m-%dT%H:%M") if match.created_from else None,
        "to": match.created_to.strftime("%Y-%m-%dT%H:%M") if match.created_to else None,
    }.items() if v}


def _charts_context(queue: str | None, task: str | None) -> dict[str, Any]:
    """The charts of the range asked for (``range``, or ``from``/``to``), rendered."""
    state = _state()
    with state.connection() as conn:
        now = conn.execute("SELECT now()").fetchone()[0]
        try:
            win = stats.window(now, request.args.get("range") or "1h", _when("from"),
                               _when("to"))
        except (ValueError, OperationError) as exc:
            flash(str(exc), "error")
            win = stats.window(now)
        data = stats.read(conn, state.q, win, queue, task)
    step = _duration(win.step).replace(" 0 s", "")
    per = f"per {step}" if win.step != 60 else "per minute"
    S = charts.Series
    svg = {
        "throughput": charts.bar_chart(
            f"Jobs finished {per}", data.points, win,
            [S("succeeded", "c-ok", lambda p: p.succeeded),
             S("retried", "c-retry", lambda p: p.retried),
             S("failed", "c-fail", lambda p: p.failed),
             S("cancelled or expired", "c-other", lambda p: p.cancelled + p.expired)],
            "no job finished in this range"),
        "failures": charts.bar_chart(
            f"Failures {per}", data.points, win,
            [S("failed (dead)", "c-fail", lambda p: p.failed),
             S("retried", "c-retry", lambda p: p.retried)],
            "no failure in this range"),
        "runtime": charts.line_chart(
            "Run time (claim to ack)", data.points, win,
            [S("p50", "c-p50", lambda p: p.run.percentile(50)),
             S("p95", "c-p95", lambda p: p.run.percentile(95)),
             S("p99", "c-p99", lambda p: p.run.percentile(99))],
            "no job ran in this range", durations=True),
        "depth": charts.line_chart(
            "Backlog (sampled each minute)", data.points, win,
            [S("pending", "c-pending", lambda p: p.pending),
             S("scheduled", "c-scheduled", lambda p: p.scheduled),
             S("running", "c-running", lambda p: p.running)],
            "no sample in this range (taken by the sweeper)"),
    }
    args = {k: v for k, v in request.args.items() if k in ("range", "from", "to")}
    return {"charts": data, "win": win, "svg": svg, "chart_args": args,
            "ranges": stats.RANGES, "now": now}


# -- views ---------------------------------------------------------------------------------------

def _install_views(app: Flask) -> None:  # noqa: C901 - one small function per route
    @app.route("/login", methods=["GET", "POST"])
    def login() -> Any:
        state = _state()
        creds = state.credentials
        if request.method == "POST":
            address = request.remote_addr or "?"
            wait = state.throttle.wait(address)
            if wait > 0:
                logger.warning("pgbroker admin: login from %s refused for %.0f s (too many "
                               "failures)", address, wait)
                flash(f"Too many failed logins: try again in {wait:.0f} s.", "error")
                return render_template("login.html", creds=creds), 429, {
                    "Retry-After": str(max(1, round(wait)))}
            found = creds.login(request.form.get("user"), request.form.get("password"),
                                request.form.get("token"))
            if found is None:
                state.throttle.failed(address)
                flash("Wrong user, password or token.", "error")
                logger.warning("pgbroker admin: failed login from %s", address)
                return render_template("login.html", creds=creds), 401
            with state.connection() as conn:
                sid = open_session(conn, state.q, found, address)
            session.clear()  # a fresh session (and CSRF token) at login: no fixation
            session["sid"] = sid
            logger.info("pgbroker admin: %s logged in (%s)", found.actor, found.role)
            return redirect(_local(request.args.get("next"), url_for("overview")), code=303)
        return render_template("login.html", creds=creds)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status=204)  # none: but no 404 in every browser console

    @app.post("/logout")
    def logout() -> Any:
        sid = session.get("sid")
        if sid:
            with _state().connection() as conn:
                close_session(conn, _state().q, sid)
        session.clear()
        return redirect(url_for("login"), code=303)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(_state().registry), mimetype=CONTENT_TYPE_LATEST)

    # -- overview, queues, charts ----------------------------------------------------------------

    def paused() -> list[dict[str, Any]]:
        """What is paused: queues now (and, once pgbroker has them, task types)."""
        return [{"kind": "queue", **r} for r in _state().rows("queue_paused_list")]

    @app.get("/")
    def overview() -> Any:
        return render_template("overview.html", snap=_state().snapshot(), paused=paused(),
                               refresh=_state().refresh, queue=None, task=None,
                               all_queues=request.args.get("all") == "1",
                               **_charts_context(None, None))

    @app.get("/overview/live")
    def overview_live() -> Any:
        return render_template("_overview.html", snap=_state().snapshot(),
                               all_queues=request.args.get("all") == "1")

    @app.get("/charts")
    def charts_live() -> Any:
        queue = request.args.get("queue") or None
        task = request.args.get("task") or None
        return render_template("_charts.html", queue=queue, task=task,
                               refresh=_state().refresh, **_charts_context(queue, task))

    @app.get("/queues/<path:name>")
    def queue(name: str) -> Any:
        snap = _state().snapshot()
        found = next((q for q in snap.queues() if q.queue == name), None)
        if found is None:
            return render_template("error.html", message=f"no queue {name!r}"), 404
        task = request.args.get("task") or None
        consumers = [c for c in _state().rows("consumer_list") if name in c["queues"]]
        return render_template("queue.html", qs=found, snap=snap, queue=name, task=task,
                               tasks=[t for t in snap.tasks if t.queue == name],
                               consumers=consumers, refresh=_state().refresh,
                               **_charts_context(name, task))

    # -- workers ---------------------------------------------------------------------------------

    def workers_context() -> dict[str, Any]:
        state = _state()
        consumers = state.rows("consumer_list")
        running = state.rows("consumer_running", limit=500)
        by_owner: dict[Any, list[dict[str, Any]]] = {}
        for job in running:
            by_owner.setdefault(job["locked_by"] if job["owned"] else None, []).append(job)
        for c in consumers:
            c["jobs"] = by_owner.get(c["id"], [])
            c["client"] = bool(c["queues"]) and all(map(is_internal_queue, c["queues"]))
            age = c["heartbeat_age"]
            c["health"] = ("lost" if age > state.lease_timeout else
                           "late" if age > 2 * state.heartbeat_interval + 1 else "alive")
        return {"consumers": [c for c in consumers if not c["client"]],
                "clients": [c for c in consumers if c["client"]],
                "orphans": by_owner.get(None, []), "running_total": len(running),
                "lease_timeout": state.lease_timeout}

    @app.get("/workers")
    def workers() -> Any:
        return render_template("workers.html", refresh=_state().refresh, **workers_context())

    @app.get("/workers/live")
    def workers_live() -> Any:
        return render_template("_workers.html", **workers_context())

    # -- jobs ------------------------------------------------------------------------------------

    @app.get("/jobs")
    def jobs() -> Any:
        q = request.args.get("q", "").strip()
        state = _state()
        if q:
            with _ops() as ops:
                try:
                    rows = ops.lookup(q)
                except OperationError as exc:
                    flash(str(exc), "error")
                    rows = []
            if len(rows) == 1:
                return redirect(url_for("job", job_id=rows[0]["id"]), code=303)
            return render_template("jobs.html", rows=rows, q=q, page=None, match=JobFilter(),
                                   states=JOB_STATES, args={}, known=[], bulk={}, counts={})
        try:
            match = _job_filter(request.args)
            before = parse_job_id(request.args["before"]) if request.args.get("before") else None
        except OperationError as exc:
            flash(str(exc), "error")
            match, before = JobFilter(), None
        with _ops() as ops:
            page = ops.browse(match, before)
        known = state.rows("stats_tasks")
        # how many of each state (the finished ones: within the metrics' window), of the
        # queue and task asked for: the metrics' numbers, cheap
        counts: dict[str, int] = {}
        for t in state.snapshot().tasks:
            if match.queue in (None, t.queue) and match.task in (None, t.task):
                for name in JOB_STATES:
                    counts[name] = counts.get(name, 0) + getattr(t, name, 0)
        bulk = {action: states for action, states in BULK_ACTIONS.items()
                if match.state is None or match.state in states}
        return render_template("jobs.html", rows=page.rows, q="", page=page, match=match,
                               states=JOB_STATES, args=_filter_args(match), known=known,
                               bulk=bulk, before=before, counts=counts)

    @app.get("/jobs/bulk")
    def jobs_bulk_confirm() -> Any:
        action = request.args.get("action", "")
        if action not in BULK_ACTIONS:
            abort(404)
        try:
            match = _job_filter(request.args)
        except OperationError as exc:
            flash(str(exc), "error")
            return redirect(url_for("jobs"), code=303)
        with _ops() as ops:
            counts = ops.count_matching(match, BULK_ACTIONS[action])
        return render_template("bulk.html", action=action, match=match, counts=counts,
                               total=sum(counts.values()), args=_filter_args(match))

    @app.post("/jobs/bulk")
    def jobs_bulk() -> Any:
        action = request.form.get("action", "")
        if action not in BULK_ACTIONS:
            abort(400, description=f"unknown bulk action {action!r}")
        try:
            match = _job_filter(request.form)
            with _ops() as ops:
                done = ops.bulk(action, match)
        except (OperationError, ValueError) as exc:
            flash(str(exc), "error")
            return redirect(url_for("jobs"), code=303)
        verb = {"retry": "Retried", "discard": "Discarded", "cancel": "Cancelled"}[action]
        flash(f"{verb} {done} job(s).", "ok")
        return redirect(url_for("jobs", **_filter_args(match)), code=303)

    @app.get("/jobs/<job_id>")
    def job(job_id: str) -> Any:
        state = _state()
        try:
            jid = parse_job_id(job_id)
        except OperationError as exc:
            return render_template("error.html", message=str(exc)), 404
        rows = state.rows("job_page", id=jid, limit=PAGE_LIMIT)
        if not rows:
            return render_template("error.html", message=f"no job with id {jid}"), 404
        row = rows[0]
        tries = state.rows("job_history", task_id=row["task_id"]) if row["task_id"] else []
        targets = [str(t["id"]) for t in tries] or [str(jid)]
        history = state.rows("audit_of_targets", targets=targets, limit=100)
        result = state.rows("result_of_task", task_id=row["task_id"]) if row["task_id"] else []
        body = bytes(row.pop("body") or b"")
        shown = body_text(body, row["content_type"], limit=PAGE_LIMIT)
        if row["body_size"] > len(body):
            shown += f"\n... cut: {row['body_size']} bytes in all"
        parts = {name: _pretty(row[name], row[f"{name}_size"])
                 for name in ("headers", "properties")}
        return render_template("job.html", job=row, body=shown, parts=parts, tries=tries,
                               history=history, result=result[0] if result else None,
                               args=_call_args(body, row["content_type"]))

    @app.get("/jobs/<job_id>/raw/<part>")
    def job_raw(job_id: str, part: str) -> Any:
        if part not in ("headers", "properties", "body"):
            abort(404)
        try:
            jid = parse_job_id(job_id)
        except OperationError:
            abort(404)
        rows = _state().rows("job_raw", id=jid, part=part)
        if not rows:
            abort(404)
        data = bytes(next(iter(rows[0].values())) or b"")
        name = f"job-{jid}-{part}" + (".json" if part != "body" else ".bin")
        return Response(data, mimetype="application/json" if part != "body"
                        else "application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    # -- dead letters, audit ---------------------------------------------------------------------

    @app.get("/dead")
    def dead() -> Any:
        queue = request.args.get("queue") or None
        with _ops() as ops:
            rows = ops.dead(queue, limit=200)
        return render_template("dead.html", rows=rows, queue=queue)

    @app.get("/audit")
    def audit() -> Any:
        with _ops() as ops:
            rows = ops.audit(request.args.get("target") or None, 200)
        return render_template("audit.html", rows=rows)

    # -- beat ------------------------------------------------------------------------------------

    @app.get("/beat")
    def beat() -> Any:
        with _state().connection() as conn:
            entries = Schedules(conn, _state().schema, actor=g.login.actor, via="admin").list()
            now = conn.execute("SELECT now()").fetchone()[0]
        return render_template("beat.html", entries=entries, now=now, paused=paused())

    # -- actions ---------------------------------------------------------------------------------

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

    def schedules(ops: Operations) -> Schedules:
        return Schedules(ops.conn, ops.settings.schema, actor=ops.actor, via="admin")

    def beat_enable(ops: Operations) -> str:
        changed = schedules(ops).set_enabled(form("name"), True)
        return f"Entry {form('name')} {'enabled' if changed else 'was already enabled'}."

    def beat_disable(ops: Operations) -> str:
        changed = schedules(ops).set_enabled(form("name"), False)
        return f"Entry {form('name')} {'disabled' if changed else 'was already disabled'}."

    def beat_run(ops: Operations) -> str:
        schedules(ops).run_now(form("name"))
        return (f"Entry {form('name')} will run at beat's next tick (within a few seconds, if "
                f"a beat is running).")

    action("/dead/retry", retry, "/dead")
    action("/dead/discard", discard, "/dead")
    action("/dead/retry-all", retry_all, "/dead")
    action("/dead/discard-all", discard_all, "/dead")
    action("/jobs/cancel", cancel)
    action("/queues/pause", pause)
    action("/queues/resume", resume)
    action("/beat/enable", beat_enable, "/beat")
    action("/beat/disable", beat_disable, "/beat")
    action("/beat/run", beat_run, "/beat")

    @app.context_processor
    def shared() -> dict[str, Any]:
        return {"small_states": SMALL_STATES}


def _pretty(text: str | None, size: int | None) -> dict[str, Any]:
    """Headers or properties for the page: indented JSON when whole, else the cut text."""
    text = text or ""
    cut = size is not None and size > len(text)
    if not cut:
        try:
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    return {"text": text, "cut": cut, "size": size}


def _call_args(body: bytes, content_type: str | None) -> dict[str, Any] | None:
    """A Celery (protocol 2) JSON body's args and kwargs, for the page; None otherwise."""
    if not content_type or "json" not in content_type:
        return None
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    if (isinstance(decoded, list) and len(decoded) == 3 and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict)):
        return {"args": json.dumps(decoded[0], indent=2, ensure_ascii=False),
                "kwargs": json.dumps(decoded[1], indent=2, ensure_ascii=False)}
    return None

