"""The pages that show the system's state: login and logout, /metrics, the overview with its
live charts, a queue's page, and the workers page.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, flash, redirect, render_template, request, session, url_for
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..metrics import is_internal_queue
from ..ops import OperationError
from . import charts, stats
from .auth import Throttled, close_session, open_session
from .present import format_duration, when
from .state import admin_state, local_target, paused

__all__ = ["charts_context", "install"]

logger = logging.getLogger("pgbroker.admin.app")  # the name its lines have always had


def charts_context(queue: str | None, task: str | None) -> dict[str, Any]:
    """The charts of the range asked for (``range``, or ``from``/``to``), rendered."""
    state = admin_state()
    with state.connection() as conn:
        now = state.now(conn)
        try:
            win = stats.window(now, request.args.get("range") or "1h", when("from"),
                               when("to"))
        except (ValueError, OperationError) as exc:
            flash(str(exc), "error")
            win = stats.window(now)
        data = stats.read(conn, state.q, win, queue, task)
    step = format_duration(win.step).replace(" 0 s", "")
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


def install(app: Flask) -> None:  # one small function per route
    """Register these pages' routes on ``app``."""
    @app.route("/login", methods=["GET", "POST"])
    def login() -> Any:
        state = admin_state()
        creds = state.credentials
        if request.method == "POST":
            address = request.remote_addr or "?"
            try:
                found = state.throttle.check(address, creds, request.form.get("user"),
                                             request.form.get("password"),
                                             request.form.get("token"))
            except Throttled as exc:
                logger.warning("pgbroker admin: login from %s refused for %.0f s (too many "
                               "failures)", address, exc.wait)
                flash(f"Too many failed logins: try again in {exc.wait:.0f} s.", "error")
                return render_template("login.html", creds=creds), 429, {
                    "Retry-After": exc.retry_after}
            if found is None:
                flash("Wrong user, password or token.", "error")
                logger.warning("pgbroker admin: failed login from %s", address)
                return render_template("login.html", creds=creds), 401
            with state.connection() as conn:
                sid = open_session(conn, state.q, found, address)
            session.clear()  # a fresh session (and CSRF token) at login: no fixation
            session["sid"] = sid
            logger.info("pgbroker admin: %s logged in (%s)", found.actor, found.role)
            return redirect(local_target(request.args.get("next"), url_for("overview")), code=303)
        return render_template("login.html", creds=creds)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status=204)  # none: but no 404 in every browser console

    @app.post("/logout")
    def logout() -> Any:
        sid = session.get("sid")
        if sid:
            with admin_state().connection() as conn:
                close_session(conn, admin_state().q, sid)
        session.clear()
        return redirect(url_for("login"), code=303)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(admin_state().registry), mimetype=CONTENT_TYPE_LATEST)

    # -- overview, queues, charts ----------------------------------------------------------------

    @app.get("/")
    def overview() -> Any:
        return render_template("overview.html", snap=admin_state().snapshot(), paused=paused(),
                               refresh=admin_state().refresh, queue=None, task=None,
                               all_queues=request.args.get("all") == "1",
                               **charts_context(None, None))

    @app.get("/overview/live")
    def overview_live() -> Any:
        return render_template("_overview.html", snap=admin_state().snapshot(),
                               all_queues=request.args.get("all") == "1")

    @app.get("/charts")
    def charts_live() -> Any:
        queue = request.args.get("queue") or None
        task = request.args.get("task") or None
        return render_template("_charts.html", queue=queue, task=task,
                               refresh=admin_state().refresh, **charts_context(queue, task))

    @app.get("/queues/<path:name>")
    def queue(name: str) -> Any:
        snap = admin_state().snapshot()
        found = next((q for q in snap.queues() if q.queue == name), None)
        if found is None:
            return render_template("error.html", message=f"no queue {name!r}"), 404
        task = request.args.get("task") or None
        consumers = [c for c in admin_state().rows("consumer_list",
                                                   lease=admin_state().lease_timeout)
                     if name in c["queues"]]
        return render_template("queue.html", qs=found, snap=snap, queue=name, task=task,
                               tasks=[t for t in snap.tasks if t.queue == name],
                               consumers=consumers, refresh=admin_state().refresh,
                               **charts_context(name, task))

    # -- workers ---------------------------------------------------------------------------------

    def workers_context() -> dict[str, Any]:
        state = admin_state()
        consumers = state.rows("consumer_list", lease=state.lease_timeout)
        running = state.rows("consumer_running", limit=500)
        by_owner: dict[Any, list[dict[str, Any]]] = {}
        for job in running:
            by_owner.setdefault(job["locked_by"] if job["owned"] else None, []).append(job)
        for c in consumers:
            c["jobs"] = by_owner.get(c["id"], [])
            c["client"] = bool(c["queues"]) and all(map(is_internal_queue, c["queues"]))
            # by its own lease (a heartbeat is at most half of it): another worker's
            # settings are not this page's
            age, lease = c["heartbeat_age"], c["lease_timeout"]
            c["health"] = ("lost" if age > lease else "late" if age > lease / 2 + 1 else "alive")
        return {"consumers": [c for c in consumers if not c["client"]],
                "clients": [c for c in consumers if c["client"]],
                "orphans": by_owner.get(None, []), "running_total": len(running),
                "lease_timeout": state.lease_timeout}

    @app.get("/workers")
    def workers() -> Any:
        return render_template("workers.html", refresh=admin_state().refresh, **workers_context())

    @app.get("/workers/live")
    def workers_live() -> Any:
        return render_template("_workers.html", **workers_context())
