"""``pgbroker``: the operator's command line (also ``python -m pgbroker``).

Every command takes ``--database-url``, ``--schema`` and ``-A``/``--app`` (a Celery app, as in
``celery -A proj``: its ``broker_url`` and ``broker_transport_options`` give the database, the
schema and the defaults of ``--lease-timeout``, ``--retention`` and ``--interval``). The database
is the first of ``--database-url``, the app's broker, ``PGBROKER_DATABASE_URL``, and
``postgresql://postgres@127.0.0.1:5432/postgres``; the schema the first of ``--schema``, the app's
``schema`` option and ``pgbroker``. Every command says on stderr which database and schema it
uses (password masked), so stdout stays parseable. Actions are audited with the operating-system
user as the actor.

Exit status: 0 done; 1 the database cannot be reached or its schema is not migrated; 2 a usage
error or an action that cannot be done as asked (a malformed or unknown job id, an unknown queue,
a job in the wrong state) -- with the reason on stderr and nothing changed. ``health`` adds 3
(stale) and 4 (missing): see :mod:`pgbroker.health`.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from contextlib import closing
from datetime import datetime
from typing import Any

import psycopg
from celery.app.utils import find_app
from kombu.transport import resolve_transport

from . import _db, health
from ._localdb import DEFAULT_LOCAL_URL, ENV_DATABASE_URL
from .errors import ConfigurationError, DatabaseUnavailable, PgBrokerError, SchemaError
from .migrate import LOCK_TIMEOUT
from .ops import (
    DEFAULT_BATCH_SIZE,
    IDLE_QUEUE_SECONDS,
    JOB_STATES,
    OperationError,
    Operations,
    body_text,
    os_user,
)
from .settings import Settings
from .transport import Transport

__all__ = ["main", "build_parser"]

EXIT_FAILURE = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
Operate a pgbroker queue: inspect jobs, handle dead letters, pause queues, sweep, serve the admin
page and Prometheus metrics. Exit status: 0 done, 1 database unreachable or schema not migrated,
2 usage error or an action that cannot be done (bad id, unknown queue, job in the wrong state);
health: 3 stale, 4 missing."""


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


# -- which database ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Target:
    """The database and schema a command works on, and where they came from."""

    url: str               # a libpq URL or key=value conninfo
    shown: str             # the same, password masked
    schema: str
    source: str            # "from --database-url", ...
    settings: Settings     # the app's transport options (-A), else the defaults

    def describe(self) -> str:
        return f"pgbroker: database {self.shown}, schema {self.schema} ({self.source})"


def target(args: argparse.Namespace) -> Target:
    """Where ``args`` point: ``--database-url``, else ``-A``'s broker, else
    ``PGBROKER_DATABASE_URL``, else the local server (never an embedded one: the CLI reads
    an existing database, it must not make an empty one)."""
    app = _app_broker(args.app) if args.app else None
    settings = app[2] if app is not None else Settings()
    env_url = os.environ.get(ENV_DATABASE_URL, "").strip()
    if args.database_url:
        url, source = _db.libpq_url(args.database_url), "from --database-url"
        shown = _db.mask_password(url)
    elif app is not None:
        url, shown, _ = app
        source = f"from the Celery app {args.app}"
    elif env_url:
        url, source = _db.libpq_url(env_url), f"from {ENV_DATABASE_URL}"
        shown = _db.mask_password(url)
    else:
        url = shown = DEFAULT_LOCAL_URL
        source = f"the default: no --database-url, -A or {ENV_DATABASE_URL}"
    schema = Settings(schema=args.schema).schema if args.schema else settings.schema
    return Target(url, shown, schema, source, settings)


def _app_broker(name: str) -> tuple[str, str, Settings]:
    """(conninfo, the URL shown with its password masked, settings) of the broker of the Celery
    app ``name`` (``proj``, ``proj.celery:app``), like ``celery -A``; it must be pgbroker."""
    try:
        app = find_app(name)  # imports from the current directory, as celery -A does
    except Exception as exc:  # noqa: BLE001 - an import error, a syntax error, a bad name
        raise ConfigurationError(f"cannot load the Celery app {name!r}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    url = str(app.conf.broker_write_url or app.conf.broker_url or "amqp://")
    scheme = url.partition("://")[0].partition("+")[0]  # pgbroker+postgresql:// -> pgbroker
    try:
        transport_cls = resolve_transport(scheme)
    except Exception:  # noqa: BLE001 - KeyError for a name kombu does not know
        transport_cls = None
    if not (isinstance(transport_cls, type) and issubclass(transport_cls, Transport)):
        raise ConfigurationError(f"the Celery app {name!r} uses the {scheme!r} broker, not "
                                 "pgbroker (broker_url = 'pgbroker://user@host/db')")
    try:
        conn = app.connection_for_write()  # no I/O: kombu parses the URL
    except Exception as exc:  # noqa: BLE001 - a malformed URL
        raise ConfigurationError(f"the Celery app {name!r} has an unusable broker_url: "
                                 f"{type(exc).__name__}: {exc}") from exc
    transport = conn.transport  # no I/O either; as_uri masks the password
    return transport.conninfo, _db.libpq_url(conn.as_uri()), transport.settings


def _url(args: argparse.Namespace) -> str:
    return args.database.url


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

    applied = migrate(_url(args), args.schema, lock_timeout=args.lock_timeout)
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
            + [q.consumers, q.deduplicated] for q in queues]
    print(_table(["QUEUE", "PAUSED"] + heads + ["CONSUMERS", "DEDUPLICATED"], rows))
    if args.by_task:
        print()
        print(_table(["QUEUE", "TASK"] + heads,
                     [[t.queue, t.task] + [getattr(t, c) for c in counts] for t in snap.tasks]))
    hidden = f"; {snap.hidden} Celery-internal queue(s) not shown" if snap.hidden else ""
    print(f"\nconsumers alive: {snap.consumers_alive}; finished jobs counted over the last "
          f"{snap.window:g} s; oldest pending age in seconds (database clock); deduplicated: "
          f"publishes dropped as duplicates, ever{hidden}")
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
        raise ConfigurationError(f"the admin page needs the admin extra: pip install "
                                 f"'/path/to/pgbroker[admin]' ({exc})") from exc
    try:
        return serve(_url(args), args.schema, host=args.host, port=args.port,
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
        with closing(_connect(args)) as conn:
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
            else:
                verdict = health.beat(conn, args.schema, tuple(args.entry), grace=args.grace)
    except PgBrokerError as exc:
        print(json.dumps({"check": args.health_command, "status": "error", "reason": str(exc)}),
              flush=True)
        raise
    print(verdict.as_json(), flush=True)
    return verdict.exit_code


def _consumer_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a consumer id (a UUID): {value!r}") from None


# -- parser --------------------------------------------------------------------------------------

def _common(suppress: bool) -> argparse.ArgumentParser:
    """--database-url/--schema/-A, accepted before and after the command name."""
    p = argparse.ArgumentParser(add_help=False)
    default: Any = argparse.SUPPRESS if suppress else None
    p.add_argument("--database-url", metavar="URL", default=default,
                   help="PostgreSQL URL (postgresql://, pgbroker://); default: the -A app's "
                        f"broker, else ${ENV_DATABASE_URL}, else {DEFAULT_LOCAL_URL}")
    p.add_argument("--schema", metavar="NAME", default=default,
                   help="pgbroker's schema (default: the -A app's schema option, else pgbroker)")
    p.add_argument("-A", "--app", metavar="APP", default=default,
                   help="a Celery app, as in celery -A (proj, proj.celery:app): its broker_url "
                        "and broker_transport_options give the database, the schema and the "
                        "defaults of --lease-timeout, --retention and --interval")
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

    d = Settings()

    def window_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--window", type=float, metavar="SECONDS",
                       help="count completed/cancelled/expired jobs finished this recently "
                            f"(default: the retention, {d.retention:g})")
        lease_option(p, "a consumer without a heartbeat for this long is not counted as alive")

    def lease_option(p: argparse.ArgumentParser, text: str) -> None:
        p.add_argument("--lease-timeout", type=float, metavar="SECONDS",
                       help=f"{text} (default: the lease_timeout option, {d.lease_timeout:g})")

    p = command("migrate", cmd_migrate, "Create or upgrade pgbroker's schema (safe to run "
                "from several hosts at once: an advisory lock serialises it).")
    p.add_argument("--lock-timeout", type=float, default=LOCK_TIMEOUT, metavar="SECONDS",
                   help="give up when another session holds the migration lock this long "
                        f"(default: {LOCK_TIMEOUT:g})")

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

    queues = sub.add_parser("queues", help="Queue maintenance.", description="Queue "
                            "maintenance.", parents=[common])
    queues_sub = queues.add_subparsers(dest="queues_command", metavar="ACTION", required=True)
    p = command("prune", _with_ops(cmd_queues_prune), "Delete the queues nobody uses: no "
                "pending, scheduled or dead job, no consumer, not paused, not declared for "
                "--idle seconds; with their bindings, and the exchanges left without one. A "
                "queue declared again is created again.", queues_sub)
    p.add_argument("--idle", type=float, default=IDLE_QUEUE_SECONDS, metavar="SECONDS",
                   help=f"unused for this long (default: {IDLE_QUEUE_SECONDS:g}, a week)")

    p = command("audit", _with_ops(cmd_audit), "Show the audit log: who did what, when.")
    p.add_argument("--target", help="only the rows about this job id or queue name")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = command("sweep", cmd_sweep, "Maintenance pass: redeliver the running jobs of lost "
                "consumers, expire, promote due scheduled jobs, prune finished rows past the "
                "retention. Workers do this themselves; run it when no worker is running.")
    p.add_argument("--loop", action="store_true", help="keep sweeping until interrupted")
    p.add_argument("--interval", type=float, metavar="SECONDS",
                   help="seconds between passes with --loop (default: the sweep_interval "
                        f"option, {d.sweep_interval:g})")
    p.add_argument("--retention", type=float, metavar="SECONDS",
                   help="keep finished jobs this long: your workers' setting (default: the "
                        f"retention option, {d.retention:g})")
    lease_option(p, "a consumer silent this long is lost: your workers' setting")

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

    text = ("Health checks for probes and monitors, one line of JSON each. Exit status: 0 ok, "
            "3 stale (there but late), 4 missing (nothing to check), 1 the database cannot be "
            "read.")
    checks = sub.add_parser("health", help=text.split(",")[0] + ".", description=text,
                            parents=[common])
    checks_sub = checks.add_subparsers(dest="health_command", metavar="CHECK", required=True)
    p = command("worker", cmd_health, "Liveness of a worker: a consumer of this host (or of "
                "--host, --pid, --node, --consumer) with a heartbeat within the lease and its "
                "database session alive.", checks_sub)
    p.add_argument("--host", help="the worker's host name (default: this host's, "
                   f"{socket.gethostname()!r}, unless --consumer is given)")
    p.add_argument("--pid", type=int, help="the worker's main process id (default: any)")
    p.add_argument("--node", metavar="NAME@HOST", help="a Celery node name: its host is "
                   "checked (the name before @ is not stored: any worker of that host counts)")
    p.add_argument("--consumer", type=_consumer_id, metavar="ID",
                   help="one consumer id (pgbroker.consumers.id), on any host")
    lease_option(p, "a heartbeat older than this is stale")
    p = command("queue", cmd_health, "Readiness of a queue: consumers alive, and its oldest due "
                "job waiting no longer than --max-pending-age.", checks_sub)
    p.add_argument("queue", metavar="QUEUE")
    p.add_argument("--max-pending-age", type=float, default=300.0, metavar="SECONDS",
                   help="stale when the oldest due job waited longer (default: 300)")
    p.add_argument("--min-consumers", type=int, default=1, metavar="N",
                   help="missing when fewer consumers are alive (default: 1; 0: do not check)")
    lease_option(p, "a consumer without a heartbeat for this long is not alive")
    p = command("beat", cmd_health, "Beat's entries: each has completed a run since its latest "
                "occurrence older than --grace (every 60 s with 60 s of grace: a run within the "
                "last 60 to 120 s).", checks_sub)
    p.add_argument("--entry", action="append", default=[], metavar="NAME",
                   help="check this entry only (repeatable; default: every enabled entry); "
                        "missing when it is unknown or disabled")
    p.add_argument("--grace", type=float, default=60.0, metavar="SECONDS",
                   help="how late a run may complete after its occurrence (default: 60)")

    # `schedule list|add|enable|disable|delete` belongs to pgbroker.beat, which adds it here.
    try:
        from .beat import register_cli
    except ImportError:  # pragma: no cover - a pgbroker without its beat scheduler
        pass
    else:
        register_cli(sub, parents=[common])
    return parser


#: Options whose default is a transport option (the -A app's, else pgbroker's default).
_FROM_SETTINGS = {"window": "retention", "retention": "retention",
                  "lease_timeout": "lease_timeout", "interval": "sweep_interval"}


def _fill_defaults(args: argparse.Namespace, settings: Settings) -> None:
    for option, name in _FROM_SETTINGS.items():
        if getattr(args, option, False) is None:
            setattr(args, option, getattr(settings, name))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.database = target(args)
        args.schema = args.database.schema
        _fill_defaults(args, args.database.settings)
        print(args.database.describe(), file=sys.stderr, flush=True)
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
