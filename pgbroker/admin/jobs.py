"""The pages that look at and act on jobs: the jobs browser and its bulk actions, a job's
whole history, dead letters, the audit log, beat's entries, and every POST action (each a
plain form through :class:`pgbroker.ops.Operations`, the same code as the CLI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask, Response, abort, flash, g, redirect, render_template, request, url_for
from werkzeug.wrappers import Response as BaseResponse

from ..beat import Schedules
from ..ops import (
    BULK_ACTIONS,
    JOB_STATES,
    SMALL_STATES,
    JobFilter,
    OperationError,
    Operations,
    body_text,
    parse_job_id,
)
from .present import PAGE_LIMIT, call_args, filter_args, job_filter, pretty
from .state import admin_state, back, operations, paused

__all__ = ["install"]


def install(app: Flask) -> None:  # one small function per route
    """Register these pages' routes and actions on ``app``."""

    @app.get("/jobs")
    def jobs() -> Any:
        q = request.args.get("q", "").strip()
        state = admin_state()
        if q:
            with operations() as ops:
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
            match = job_filter(request.args)
            before = parse_job_id(request.args["before"]) if request.args.get("before") else None
        except OperationError as exc:
            flash(str(exc), "error")
            match, before = JobFilter(), None
        with operations() as ops:
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
                               states=JOB_STATES, args=filter_args(match), known=known,
                               bulk=bulk, before=before, counts=counts)

    @app.get("/jobs/bulk")
    def jobs_bulk_confirm() -> Any:
        action = request.args.get("action", "")
        if action not in BULK_ACTIONS:
            abort(404)
        try:
            match = job_filter(request.args)
        except OperationError as exc:
            flash(str(exc), "error")
            return redirect(url_for("jobs"), code=303)
        with operations() as ops:
            counts = ops.count_matching(match, BULK_ACTIONS[action])
        return render_template("bulk.html", action=action, match=match, counts=counts,
                               total=sum(counts.values()), args=filter_args(match))

    @app.post("/jobs/bulk")
    def jobs_bulk() -> Any:
        action = request.form.get("action", "")
        if action not in BULK_ACTIONS:
            abort(400, description=f"unknown bulk action {action!r}")
        try:
            match = job_filter(request.form)
            with operations() as ops:
                done = ops.bulk(action, match)
        except (OperationError, ValueError) as exc:
            flash(str(exc), "error")
            return redirect(url_for("jobs"), code=303)
        verb = {"retry": "Retried", "discard": "Discarded", "cancel": "Cancelled"}[action]
        flash(f"{verb} {done} job(s).", "ok")
        values: dict[str, Any] = filter_args(match)  # (url_for's own arguments start with _)
        return redirect(url_for("jobs", **values), code=303)

    @app.get("/jobs/<job_id>")
    def job(job_id: str) -> Any:
        state = admin_state()
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
        parts = {name: pretty(row[name], row[f"{name}_size"])
                 for name in ("headers", "properties")}
        return render_template("job.html", job=row, body=shown, parts=parts, tries=tries,
                               history=history, result=result[0] if result else None,
                               args=call_args(body, row["content_type"]))

    @app.get("/jobs/<job_id>/raw/<part>")
    def job_raw(job_id: str, part: str) -> Any:
        if part not in ("headers", "properties", "body"):
            abort(404)
        try:
            jid = parse_job_id(job_id)
        except OperationError:
            abort(404)
        rows = admin_state().rows("job_raw", id=jid, part=part)
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
        with operations() as ops:
            rows = ops.dead(queue, limit=200)
        return render_template("dead.html", rows=rows, queue=queue)

    @app.get("/audit")
    def audit() -> Any:
        with operations() as ops:
            rows = ops.audit(request.args.get("target") or None, 200)
        return render_template("audit.html", rows=rows)

    # -- beat ------------------------------------------------------------------------------------

    @app.get("/beat")
    def beat() -> Any:
        with admin_state().connection() as conn:
            entries = Schedules(conn, admin_state().schema, actor=g.login.actor, via="admin").list()
            now = admin_state().now(conn)
        return render_template("beat.html", entries=entries, now=now, paused=paused())

    # -- actions ---------------------------------------------------------------------------------

    def action(path: str, run: Callable[[Operations], str], default: str = "/") -> None:
        def view() -> BaseResponse:
            with operations() as ops:
                try:
                    flash(run(ops), "ok")
                except OperationError as exc:
                    flash(str(exc), "error")
            return back(default)

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

    def resume_task(ops: Operations) -> str:
        changed = ops.resume_task(form("task"), form("reason"))
        return f"Task {form('task')} {'resumed' if changed else 'was not paused'}."

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
    action("/tasks/resume", resume_task)
    action("/beat/enable", beat_enable, "/beat")
    action("/beat/disable", beat_disable, "/beat")
    action("/beat/run", beat_run, "/beat")

    @app.context_processor
    def shared() -> dict[str, Any]:
        return {"small_states": SMALL_STATES}
