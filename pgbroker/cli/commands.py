"""The handlers of the ``pgbroker`` commands (their options are in :mod:`pgbroker.cli.parser`).

Each takes the parsed arguments (those acting through :class:`~pgbroker.ops.Operations` get one
from :func:`~pgbroker.cli._support.with_ops`), prints its result on stdout and returns the exit
status; a mistake raises :class:`~pgbroker.errors.OperationError`, which ``main`` turns into 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from contextlib import closing
from typing import Any

from celery.app.utils import find_app

from .. import health
from .._model.message import message_to_job
from .._pg.store import Store
from .._pg.vacuum import VacuumReport
from .._produce.revoke import RevokeRequest, apply, pidbox_message
from ..errors import ConfigurationError, OperationError, PgBrokerError
from ..metrics import MetricsReader
from ..migrate import latest_version, migrate
from ..ops import Operations, body_text
from ..settings import Settings
from ..sweeper import Sweeper
from ._support import connect, first_line, fmt, progress, table, to_json, url_of


def cmd_migrate(args: argparse.Namespace) -> int:
    applied = migrate(url_of(args), args.schema, lock_timeout=args.lock_timeout)
    if applied:
        print(f"schema {args.schema}: applied migration(s) {', '.join(map(str, applied))}")
    else:
        print(f"schema {args.schema}: up to date (version {latest_version()})")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    reader = MetricsReader(args.schema, window=args.window, lease_timeout=args.lease_timeout,
                           include_internal=args.all_queues)
    with closing(connect(args)) as conn:
        snap = reader.snapshot(conn)
    if args.json:
        print(to_json(snap.as_dict()))
        return 0
    counts = ["pending", "scheduled", "running", "dead", "poison", "completed", "retried",
              "cancelled", "expired", "redelivered", "oldest_pending_age"]
    heads = [c.upper().replace("_", " ") for c in counts]
    queues = snap.queues()
    rows = [[q.queue, "yes" if q.paused else "no"] + [getattr(q, c) for c in counts]
            + [q.consumers, q.deduplicated] for q in queues]
    print(table(["QUEUE", "PAUSED"] + heads + ["CONSUMERS", "DEDUPLICATED"], rows))
    if args.by_task:
        print()
        print(table(["QUEUE", "TASK"] + heads,
                     [[t.queue, t.task] + [getattr(t, c) for c in counts] for t in snap.tasks]))
    hidden = f"; {snap.hidden} Celery-internal queue(s) not shown" if snap.hidden else ""
    print(f"\nconsumers alive: {snap.consumers_alive}; finished jobs counted over the last "
          f"{snap.window:g} s; oldest pending age in seconds (database clock); deduplicated: "
          f"publishes dropped as duplicates, ever{hidden}")
    for entry, age in snap.beat.items():
        print(f"beat {entry}: last run {'never' if age is None else f'{age:.0f} s ago'}")
    for task, p in snap.paused_tasks.items():
        print(f"task {task}: PAUSED since {p['paused_at']:%Y-%m-%d %H:%M:%S} by {p['paused_by']}"
              f" ({p['waiting']} job(s) waiting): {first_line(p['reason'])}; jobs that caused "
              f"it: {' '.join(map(str, p['job_ids'])) or '-'} (pgbroker task resume {task})")
    print()
    print(vacuum_text(snap.vacuum))
    return 0


def vacuum_text(report: VacuumReport) -> str:
    """Who holds back VACUUM's horizon, and the hot tables' row versions (``stats``)."""
    lines = ["VACUUM's horizon: " + ("nothing holds it" if not report.holders else
                                     f"held by {report.holders[0].describe()}")]
    lines += [f"  then {h.describe()}" for h in report.holders[1:]]
    if report.hidden:
        lines.append("  (the state, start and query of another role's session are hidden from "
                     "this one: grant it pg_read_all_stats to see them)")
    lines.append(table(["TABLE", "LIVE", "DEAD", "LAST VACUUM", "AUTOVACUUM"],
                       [[t.table, t.live, t.dead, t.vacuumed_at,
                         "on" if t.autovacuum else "OFF"] for t in report.tables]))
    return "\n".join(lines)


_JOB_COLUMNS = ["id", "queue", "task", "state", "attempts", "updated_at"]


def _job_rows(rows: list[dict[str, Any]]) -> str:
    return table(["ID", "QUEUE", "TASK", "STATE", "ATTEMPTS", "UPDATED", "LAST ERROR"],
                  [[r[c] for c in _JOB_COLUMNS] + [first_line(r["last_error"])] for r in rows])


def cmd_jobs_list(ops: Operations, args: argparse.Namespace) -> int:
    rows = ops.jobs(args.queue, args.state, args.task, args.limit)
    print(to_json(rows) if args.json else _job_rows(rows))
    return 0


def cmd_jobs_show(ops: Operations, args: argparse.Namespace) -> int:
    rows = ops.lookup(args.id)
    if not rows:
        raise OperationError(f"no job has the id, Celery task id or idempotency key {args.id!r}")
    # the newest match; with a Celery task id, the newest try of its chain
    job = rows[0] if "body" in rows[0] else ops.job(rows[0]["id"])
    chain = ops.chain(job["task_id"]) if job["task_id"] else []
    if not {r["id"] for r in rows} <= {t["id"] for t in chain} | {job["id"]}:
        print(f"{len(rows)} jobs match {args.id!r}:")
        print(_job_rows(rows))
        return 0
    body = body_text(job.pop("body"), job["content_type"])
    job["retried"] = any(t["retried"] for t in chain if t["id"] == job["id"])
    if args.json:
        print(to_json({**job, "body": body, "chain": chain}))
        return 0
    width = max(len(k) for k in job)
    for key, value in job.items():
        if key in ("last_traceback", "headers", "properties", "retried"):
            continue
        if key == "state" and job["retried"]:
            value = "retried (completed: its task sent a Celery retry, the next try below)"
        print(f"{key.ljust(width)}  {fmt(value)}")
    if len(chain) > 1:
        print(f"tries of Celery task id {job['task_id']} ({len(chain)}; each Celery retry is a "
              "new job with retries + 1):")
        print(table(["RETRIES", "JOB", "QUEUE", "STATE", "ATTEMPTS", "CREATED", "CLAIMED",
                     "FINISHED OR UPDATED", "LAST ERROR"],
                    [[t["retries"], t["id"], t["queue"], "retried" if t["retried"] else t["state"],
                      f"{t['attempts']}/{t['max_attempts']}", t["created_at"], t["locked_at"],
                      t["updated_at"], first_line(t["last_error"])] for t in chain]))
    for key in ("headers", "properties"):
        print(f"{key}:\n{json.dumps(job[key], indent=2, default=str)}")
    if job["last_traceback"]:
        print(f"last_traceback:\n{job['last_traceback']}")
    print(f"body:\n{body}")
    return 0


def _print_rows(rows: list[dict[str, Any]], as_json: bool, headers: Sequence[str],
                cells: Callable[[dict[str, Any]], Sequence[Any]]) -> int:
    print(to_json(rows) if as_json else table(headers, [cells(r) for r in rows]))
    return 0


def cmd_dead_list(ops: Operations, args: argparse.Namespace) -> int:
    return _print_rows(
        ops.dead(args.queue, args.limit), args.json,
        ["ID", "QUEUE", "TASK", "RUNS", "ATTEMPTS", "DIED", "POISON", "ERROR"],
        # RUNS: deliveries of the task across Celery's retries (each retry is a new row, with
        # attempts of its own); ATTEMPTS: this row's
        lambda r: [r["id"], r["queue"], r["task"], _runs(r),
                   f"{r['attempts']}/{r['max_attempts']}", r["updated_at"],
                   "POISON" if r["poison"] else "",
                   first_line(r["last_error"])])


def _runs(row: dict[str, Any]) -> str:
    retries = row["retries"]
    return f"{row['runs']}" + (f" ({retries} retr{'y' if retries == 1 else 'ies'})"
                               if retries else "")


def dead_action(action: str) -> Callable[[Operations, argparse.Namespace], int]:
    verb = "retried" if action == "retry" else "discarded"

    def run(ops: Operations, args: argparse.Namespace) -> int:
        if args.all == bool(args.id):
            raise OperationError(f"give either a job id or --all to {action} dead jobs")
        if args.id:
            if args.queue:
                raise OperationError("--queue goes with --all only")
            getattr(ops, f"{action}_dead")(args.id)
            print(f"{verb} dead job {args.id}")
            return 0
        n = getattr(ops, f"{action}_all_dead")(args.queue, batch_size=args.batch_size,
                                               progress=progress(verb))
        print(f"{verb} {n} dead job(s)" + (f" of queue {args.queue}" if args.queue else ""))
        return 0

    return run


def cmd_cancel(ops: Operations, args: argparse.Namespace) -> int:
    ops.cancel(args.id)
    print(f"cancelled job {args.id}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    request = RevokeRequest(tuple(dict.fromkeys(args.ids)), args.terminate, args.signal)
    store = Store(url_of(args), Settings(schema=args.schema, auto_migrate=False),
                  application_name="pgbroker cli")
    message = pidbox_message(request, args.control_exchange)
    try:
        store.connect()  # checks the schema: a clear error if it is not migrated
        outcomes = apply(store, request, message_to_job(store.settings, None, message),
                         via="cli", log=False)
    finally:
        store.close()
    for outcome in outcomes:
        print(f"{outcome.task_id}: {outcome}")
    return 0


def cmd_purge(ops: Operations, args: argparse.Namespace) -> int:
    n = ops.purge(args.queue, batch_size=args.batch_size, progress=progress("deleted"))
    print(f"purged {n} pending or scheduled job(s) of queue {args.queue}")
    return 0


def cmd_pause(ops: Operations, args: argparse.Namespace) -> int:
    changed = ops.pause(args.queue)
    print(f"queue {args.queue} {'paused' if changed else 'was already paused'}")
    return 0


def cmd_resume(ops: Operations, args: argparse.Namespace) -> int:
    changed = ops.resume(args.queue)
    print(f"queue {args.queue} {'resumed' if changed else 'was not paused'}")
    return 0


def cmd_queues_prune(ops: Operations, args: argparse.Namespace) -> int:
    queues, exchanges = ops.prune_queues(args.idle)
    print(f"deleted {queues} unused queue(s) (with their bindings) and {exchanges} exchange(s) "
          "without bindings")
    return 0


def cmd_audit(ops: Operations, args: argparse.Namespace) -> int:
    return _print_rows(
        ops.audit(args.target, args.limit), args.json,
        ["AT", "ACTOR", "ACTION", "TARGET", "DETAIL"],
        lambda r: [r["at"], r["actor"], r["action"], r["target"],
                   first_line(json.dumps(r["detail"], default=str), 80)])


def cmd_sweep(args: argparse.Namespace) -> int:
    settings = Settings(schema=args.schema, auto_migrate=False, retention=args.retention,
                        lease_timeout=args.lease_timeout,
                        heartbeat_interval=args.lease_timeout / 2,
                        pause_task_after=args.database.settings.pause_task_after)
    if args.app:
        # the app's modules (its include list), as a worker imports them: their receivers of
        # pgbroker.signals (job_dead, task_paused) hear what this sweep does
        find_app(args.app).loader.import_default_modules()
    store = Store(url_of(args), settings, application_name="pgbroker sweep")
    stop = threading.Event()
    if args.loop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        store.connect()  # checks the schema: a clear error now, not in the loop
        # one sweeper for the loop: it warns of a held horizon once, not at every pass
        sweeper = Sweeper(store, background_vacuum=False)
        while True:
            result = sweeper.run_once()
            if result or not args.loop:
                print("sweep: " + ", ".join(f"{k} {v}" for k, v in vars(result).items()),
                      flush=True)
            if not args.loop or stop.wait(args.interval):
                return 0
    finally:
        store.close()


def cmd_serve(args: argparse.Namespace) -> int:
    try:  # here, not at the top: the admin page needs the optional admin extra (flask)
        from ..admin import serve
    except ImportError as exc:
        raise ConfigurationError(f"the admin page needs the admin extra: pip install "
                                 f"'/path/to/pgbroker[admin]' ({exc})") from exc
    try:
        return serve(url_of(args), args.schema, host=args.host, port=args.port,
                     refresh=args.refresh, window=args.window,
                     lease_timeout=args.lease_timeout, threads=args.threads)
    except OSError as exc:  # binding the listening socket (waitress.create_server)
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise
        raise OperationError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}; "
                             "choose another port with --port (--port 0: any free one)") from exc


def cmd_health(args: argparse.Namespace) -> int:
    """One check, one line of JSON on stdout, its exit status (also when it cannot check)."""
    try:
        with closing(connect(args)) as conn:
            if args.health_command == "worker":
                host = (args.node.rpartition("@")[2] if args.node else args.host
                        or (None if args.consumer else socket.gethostname()))
                verdict = health.worker(conn, args.schema, host=host, pid=args.pid,
                                        consumer=args.consumer, lease_timeout=args.lease_timeout)
            elif args.health_command == "queue":
                verdict = health.queue(conn, args.schema, args.queue,
                                       max_pending_age=args.max_pending_age,
                                       min_consumers=args.min_consumers,
                                       lease_timeout=args.lease_timeout)
            elif args.health_command == "vacuum":
                verdict = health.vacuum(conn, args.schema, max_age=args.max_age,
                                        max_xid_age=args.max_xid_age)
            else:
                verdict = health.beat(conn, args.schema, tuple(args.entry), grace=args.grace)
    except PgBrokerError as exc:
        print(json.dumps({"check": args.health_command, "status": "error", "reason": str(exc)}),
              flush=True)
        raise
    print(verdict.as_json(), flush=True)
    return verdict.exit_code


def consumer_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a consumer id (a UUID): {value!r}") from None
