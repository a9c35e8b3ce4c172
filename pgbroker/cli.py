"""``pgbroker``: the operator's command line (also ``python -m pgbroker``).

Every command takes ``--database-url`` (default: ``PGBROKER_DATABASE_URL``, else the local
server, see :mod:`pgbroker._localdb`) and ``--schema`` (default ``pgbroker``). Actions are audited
with the operating-system user as the actor.

Exit status: 0 done; 1 the database cannot be reached or its schema is not migrated; 2 a usage
error or an action that cannot be done as asked (a malformed or unknown job id, an unknown queue,
a job in the wrong state) -- with the reason on stderr and nothing changed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import closing
from datetime import datetime
from typing import Any

import psycopg

from . import _db
from .errors import ConfigurationError, DatabaseUnavailable, PgBrokerError, SchemaError
from .ops import DEFAULT_BATCH_SIZE, JOB_STATES, OperationError, Operations, body_text, os_user
from .settings import Settings

__all__ = ["main", "build_parser"]

EXIT_FAILURE = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
Operate a pgbroker queue: inspect jobs, handle dead letters, pause queues, sweep, serve the admin
page and Prometheus metrics. Exit status: 0 done, 1 database unreachable or schema not migrated,
2 usage error or an action that cannot be done (bad id, unknown queue, job in the wrong state)."""


# -- output helpers ------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _first_line(text: str | None, width: int = 60) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= width else line[:width - 1] + "…"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _json(data: Any) -> str:
    def default(value: Any) -> Any:
        if isinstance(value, (bytes, memoryview)):
            return None  # bodies are shown by `jobs show`, decoded
        if isinstance(value, datetime):
            return value.isoformat()
        return str(value)

    return json.dumps(data, indent=2, default=default, ensure_ascii=False)


def _progress(verb: str) -> Callable[[int, int], None]:
    def report(done: int, total: int) -> None:
        print(f"{verb} {done} of {total}", file=sys.stderr, flush=True)

    return report


# -- connection ----------------------------------------------------------------------------------

def _url(args: argparse.Namespace) -> str:
    if args.database_url:
        return _db.libpq_url(args.database_url)
    from ._localdb import resolve_database_url

    return resolve_database_url("pgbroker cli")


def _connect(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """A connection to a migrated schema (or :class:`SchemaError` saying to migrate)."""
    from .migrate import check

    Settings(schema=args.schema)
    conn = _db.connect(_url(args), application_name="pgbroker cli")
    try:
        with _db.translate_errors("checking the pgbroker schema"):
            check(conn, args.schema)
    except BaseException:
        _db.close(conn)
        raise
    return conn


def _with_ops(handler: Callable[[Operations, argparse.Namespace], int | None]
              ) -> Callable[[argparse.Namespace], int | None]:
    def run(args: argparse.Namespace) -> int | None:
        with closing(_connect(args)) as conn:
            return handler(Operations(conn, args.schema, actor=os_user(), via="cli"), args)

    return run


# -- commands ------------------------------------------------------------------------------------

def cmd_migrate(args: argparse.Namespace) -> int:
    from .migrate import latest_version, migrate

    applied = migrate(_url(args), args.schema)
    if applied:
        print(f"schema {args.schema}: applied migration(s) {', '.join(map(str, applied))}")
    else:
        print(f"schema {args.schema}: up to date (version {latest_version()})")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from .metrics import MetricsReader

    reader = MetricsReader(args.schema, window=args.window, lease_timeout=args.lease_timeout,
                           include_internal=args.all_queues)
    with closing(_connect(args)) as conn:
        snap = reader.snapshot(conn)
    if args.json:
        print(_json(snap.as_dict()))
        return 0
    counts = ["pending", "scheduled", "running", "dead", "poison", "completed", "cancelled",
              "expired", "redelivered", "oldest_pending_age"]
    heads = [c.upper().replace("_", " ") for c in counts]
    queues = snap.queues()
    rows = [[q.queue, "yes" if q.paused else "no"] + [getattr(q, c) for c in counts]
            + [q.consumers] for q in queues]
    print(_table(["QUEUE", "PAUSED"] + heads + ["CONSUMERS"], rows))
    if args.by_task:
        print()
        print(_table(["QUEUE", "TASK"] + heads,
                     [[t.queue, t.task] + [getattr(t, c) for c in counts] for t in snap.tasks]))
    hidden = f"; {snap.hidden} Celery-internal queue(s) not shown" if snap.hidden else ""
    print(f"\nconsumers alive: {snap.consumers_alive}; finished jobs counted over the last "
          f"{snap.window:g} s; oldest pending age in seconds (database clock){hidden}")
    for entry, age in snap.beat.items():
        print(f"beat {entry}: last run {'never' if age is None else f'{age:.0f} s ago'}")
    return 0


_JOB_COLUMNS = ["id", "queue", "task", "state", "attempts", "updated_at"]


def _job_rows(rows: list[dict[str, Any]]) -> str:
    return _table(["ID", "QUEUE", "TASK", "STATE", "ATTEMPTS", "UPDATED", "LAST ERROR"],
                  [[r[c] for c in _JOB_COLUMNS] + [_first_line(r["last_error"])] for r in rows])


def cmd_jobs_list(ops: Operations, args: argparse.Namespace) -> int:
    rows = ops.jobs(args.queue, args.state, args.task, args.limit)
    print(_json(rows) if args.json else _job_rows(rows))
    return 0


def cmd_jobs_show(ops: Operations, args: argparse.Namespace) -> int:
    rows = ops.lookup(args.id)
    if not rows:
        raise OperationError(f"no job has the id, Celery task id or idempotency key {args.id!r}")
    if len(rows) > 1:
        print(f"{len(rows)} jobs match {args.id!r}:")
        print(_job_rows(rows))
        return 0
    job = rows[0] if "body" in rows[0] else ops.job(rows[0]["id"])
    body = body_text(job.pop("body"), job["content_type"])
    if args.json:
        print(_json({**job, "body": body}))
        return 0
    width = max(len(k) for k in job)
    for key, value in job.items():
        if key in ("last_traceback", "headers", "properties"):
            continue
        print(f"{key.ljust(width)}  {_fmt(value)}")
    for key in ("headers", "properties"):
        print(f"{key}:\n{json.dumps(job[key], indent=2, default=str)}")
    if job["last_traceback"]:
        print(f"last_traceback:\n{job['last_traceback']}")
    print(f"body:\n{body}")
    return 0


def _print_rows(rows: list[dict[str, Any]], as_json: bool, headers: Sequence[str],
                cells: Callable[[dict[str, Any]], Sequence[Any]]) -> int:
    print(_json(rows) if as_json else _table(headers, [cells(r) for r in rows]))
    return 0


def cmd_dead_list(ops: Operations, args: argparse.Namespace) -> int:
    return _print_rows(
        ops.dead(args.queue, args.limit), args.json,
        ["ID", "QUEUE", "TASK", "ATTEMPTS", "DIED", "POISON", "ERROR"],
        lambda r: [r["id"], r["queue"], r["task"], f"{r['attempts']}/{r['max_attempts']}",
                   r["updated_at"], "POISON" if r["poison"] else "",
                   _first_line(r["last_error"])])


def _dead_action(action: str) -> Callable[[Operations, argparse.Namespace], int]:
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
                                               progress=_progress(verb))
        print(f"{verb} {n} dead job(s)" + (f" of queue {args.queue}" if args.queue else ""))
        return 0

    return run


def cmd_cancel(ops: Operations, args: argparse.Namespace) -> int:
    ops.cancel(args.id)
    print(f"cancelled job {args.id}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from ._messages import message_to_job
    from ._revoke import RevokeRequest, apply, pidbox_message
    from ._store import Store

    request = RevokeRequest(tuple(dict.fromkeys(args.ids)), args.terminate, args.signal)
    store = Store(_url(args), Settings(schema=args.schema, auto_migrate=False),
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
    n = ops.purge(args.queue, batch_size=args.batch_size, progress=_progress("deleted"))
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


def cmd_audit(ops: Operations, args: argparse.Namespace) -> int:
    return _print_rows(
        ops.audit(args.target, args.limit), args.json,
        ["AT", "ACTOR", "ACTION", "TARGET", "DETAIL"],
        lambda r: [r["at"], r["actor"], r["action"], r["target"],
                   _first_line(json.dumps(r["detail"], default=str), 80)])


def cmd_sweep(args: argparse.Namespace) -> int:
    from ._store import Store
    from .sweeper import Sweeper

    settings = Settings(schema=args.schema, auto_migrate=False, retention=args.retention,
                        lease_timeout=args.lease_timeout,
                        heartbeat_interval=args.lease_timeout / 2)
    store = Store(_url(args), settings, application_name="pgbroker sweep")
    stop = threading.Event()
    if args.loop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        store.connect()  # checks the schema: a clear error now, not in the loop
        while True:
            result = Sweeper(store).run_once()
            if result or not args.loop:
                print("sweep: " + ", ".join(f"{k} {v}" for k, v in vars(result).items()),
                      flush=True)
            if not args.loop or stop.wait(args.interval):
                return 0
    finally:
        store.close()


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .admin import serve
    except ImportError as exc:
        raise ConfigurationError(f"the admin page needs its extra: pip install "
                                 f"'pgbroker[admin]' ({exc})") from exc
    return serve(_url(args), args.schema, host=args.host, port=args.port, refresh=args.refresh,
                 window=args.window, lease_timeout=args.lease_timeout, threads=args.threads)


# -- parser --------------------------------------------------------------------------------------

def _common(suppress: bool) -> argparse.ArgumentParser:
    """--database-url/--schema, accepted before and after the command name."""
    p = argparse.ArgumentParser(add_help=False)
    default: Any = argparse.SUPPRESS if suppress else None
    p.add_argument("--database-url", metavar="URL", default=default,
                   help="PostgreSQL URL (postgresql://, pgbroker://); default: "
                        "$PGBROKER_DATABASE_URL, else postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--schema", metavar="NAME", default=argparse.SUPPRESS if suppress
                   else "pgbroker", help="pgbroker's schema (default: pgbroker)")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``pgbroker`` argument parser (every command's handler in ``func``)."""
    common = _common(suppress=True)
    parser = argparse.ArgumentParser(prog="pgbroker", description=_DESCRIPTION,
                                     parents=[_common(suppress=False)])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, func: Callable[..., Any], help: str,
                where: Any = sub) -> argparse.ArgumentParser:
        p = where.add_parser(name, help=help, description=help, parents=[common])
        p.set_defaults(func=func)
        return p

    def window_options(p: argparse.ArgumentParser) -> None:
        d = Settings()
        p.add_argument("--window", type=float, default=d.retention, metavar="SECONDS",
                       help="count completed/cancelled/expired jobs finished this recently "
                            f"(default: {d.retention:g}, the default retention)")
        p.add_argument("--lease-timeout", type=float, default=d.lease_timeout,
                       metavar="SECONDS", help="a consumer without a heartbeat for this long is "
                       f"not counted as alive (default: {d.lease_timeout:g})")

    command("migrate", cmd_migrate, "Create or upgrade pgbroker's schema (safe to run from "
            "several hosts at once: an advisory lock serialises it).")

    p = command("stats", cmd_stats, "Show the queues' numbers: pending (due), scheduled, "
                "running, dead, poison, completed/cancelled/expired within the window, "
                "redelivered, age of the oldest pending job, consumers alive.")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--by-task", action="store_true", help="also break the numbers down by task")
    p.add_argument("--all-queues", action="store_true", help="include Celery's internal queues "
                   "(remote control *.pidbox, events celeryev.*)")
    window_options(p)

    jobs = sub.add_parser("jobs", help="List jobs, or show one in full.",
                          description="List jobs, or show one in full.", parents=[common])
    jobs_sub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    p = command("list", _with_ops(cmd_jobs_list), "List the newest jobs, optionally filtered.",
                jobs_sub)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--state", choices=JOB_STATES, help="only this state")
    p.add_argument("--task", help="only this task name")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p = command("show", _with_ops(cmd_jobs_show), "Show one job in full: state, attempts, error "
                "and traceback, headers, decoded body.", jobs_sub)
    p.add_argument("id", metavar="ID", help="job id, Celery task id, or idempotency key")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    dead = sub.add_parser("dead", help="Dead letters: list, retry, discard.",
                          description="Dead letters: jobs that failed for good, out of attempts, "
                          "or rejected. Poison jobs (their consumer was lost during every "
                          "attempt) are marked.", parents=[common])
    dead_sub = dead.add_subparsers(dest="dead_command", metavar="ACTION", required=True)
    p = command("list", _with_ops(cmd_dead_list), "List dead jobs, most recent first.", dead_sub)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    for action, text in (("retry", "Put dead jobs back to pending with their attempts reset to "
                                   "0 (their last error is kept in the audit log); workers pick "
                                   "them up at once."),
                         ("discard", "Delete dead jobs for good (the audit log keeps their "
                                     "queue, task, error and traceback).")):
        p = command(action, _with_ops(_dead_action(action)), text, dead_sub)
        p.add_argument("id", metavar="ID", nargs="?", help="the dead job's id")
        p.add_argument("--all", action="store_true", help="every dead job (of --queue)")
        p.add_argument("--queue", help="with --all: only this queue")
        p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                       help=f"jobs per transaction with --all (default: {DEFAULT_BATCH_SIZE})")

    p = command("cancel", _with_ops(cmd_cancel), "Cancel a pending or scheduled job: it will "
                "never run (a running job cannot be taken back from its worker).")
    p.add_argument("id", metavar="ID", help="the job's id")

    p = command("revoke", cmd_revoke, "Revoke Celery tasks by task id, as `celery control "
                "revoke` does over pgbroker: pending and scheduled jobs are cancelled, running "
                "or prefetched ones end cancelled when their delivery ends, and the live "
                "workers are told. Prints what happened to each id.")
    p.add_argument("ids", metavar="TASK_ID", nargs="+", help="Celery task ids")
    p.add_argument("--terminate", action="store_true", help="also stop the task where it runs "
                   "(Celery sends the signal to its pool process)")
    p.add_argument("--signal", default=None, help="with --terminate: the signal (default: "
                   "SIGTERM)")
    p.add_argument("--control-exchange", default="celery", metavar="NAME",
                   help="your app's control_exchange setting (default: celery)")

    p = command("purge", _with_ops(cmd_purge), "Delete every pending and scheduled job of a "
                "queue, in batches with progress (running jobs finish; dead ones stay).")
    p.add_argument("queue", metavar="QUEUE")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"jobs per transaction (default: {DEFAULT_BATCH_SIZE})")

    p = command("pause", _with_ops(cmd_pause), "Pause a queue: no worker claims its jobs until "
                "it is resumed (jobs already running finish; publishing goes on).")
    p.add_argument("queue", metavar="QUEUE")
    p = command("resume", _with_ops(cmd_resume), "Resume a paused queue; its workers are woken "
                "at once.")
    p.add_argument("queue", metavar="QUEUE")

    p = command("audit", _with_ops(cmd_audit), "Show the audit log: who did what, when.")
    p.add_argument("--target", help="only the rows about this job id or queue name")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    d = Settings()
    p = command("sweep", cmd_sweep, "Maintenance pass: redeliver the running jobs of lost "
                "consumers, expire, promote due scheduled jobs, prune finished rows past the "
                "retention. Workers do this themselves; run it when no worker is running.")
    p.add_argument("--loop", action="store_true", help="keep sweeping until interrupted")
    p.add_argument("--interval", type=float, default=d.sweep_interval, metavar="SECONDS",
                   help=f"seconds between passes with --loop (default: {d.sweep_interval:g})")
    p.add_argument("--retention", type=float, default=d.retention, metavar="SECONDS",
                   help="keep finished jobs this long: use your workers' setting "
                        f"(default: {d.retention:g})")
    p.add_argument("--lease-timeout", type=float, default=d.lease_timeout, metavar="SECONDS",
                   help="a consumer silent this long is lost: use your workers' setting "
                        f"(default: {d.lease_timeout:g})")

    p = command("serve", cmd_serve, "Serve the admin page and Prometheus metrics (/metrics). "
                "Needs PGBROKER_ADMIN_USER and PGBROKER_ADMIN_PASSWORD, or PGBROKER_ADMIN_TOKEN; "
                "on a loopback address without them, a one-time token is printed.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1; any other address requires credentials)")
    p.add_argument("--port", type=int, default=8025, help="port (default: 8025; 0: any free)")
    p.add_argument("--refresh", type=float, default=3.0, metavar="SECONDS",
                   help="seconds between live updates of the overview (default: 3)")
    p.add_argument("--threads", type=int, default=4, help="request threads (default: 4)")
    window_options(p)

    # `schedule list|add|enable|disable|delete` belongs to pgbroker.beat, which adds it here.
    try:
        from .beat import register_cli
    except ImportError:  # pragma: no cover - a pgbroker without its beat scheduler
        pass
    else:
        register_cli(sub, parents=[common])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (OperationError, ConfigurationError, ValueError) as exc:
        print(f"pgbroker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (DatabaseUnavailable, SchemaError) as exc:
        print(f"pgbroker: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except PgBrokerError as exc:
        print(f"pgbroker: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("pgbroker: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
