"""The ``pgbroker`` argument parser: every command, its options and help, and its handler.

The handlers are in :mod:`pgbroker.cli.commands` (and :mod:`pgbroker.cli.schedule`, which adds
its own ``schedule`` command); options whose default is a transport option are filled in by
:func:`fill_defaults` once the database (and so the app's settings) is known.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import Any

from .._pg.local_server import DEFAULT_LOCAL_URL, ENV_DATABASE_URL
from ..migrate import LOCK_TIMEOUT
from ..ops import DEFAULT_BATCH_SIZE, IDLE_QUEUE_SECONDS, JOB_STATES
from ..settings import Settings
from . import schedule, tasks
from ._support import with_ops
from .commands import (
    cmd_audit,
    cmd_cancel,
    cmd_dead_list,
    cmd_health,
    cmd_jobs_list,
    cmd_jobs_show,
    cmd_migrate,
    cmd_pause,
    cmd_purge,
    cmd_queues_prune,
    cmd_resume,
    cmd_revoke,
    cmd_serve,
    cmd_stats,
    cmd_sweep,
    consumer_id,
    dead_action,
)

__all__ = ["DESCRIPTION", "build_parser", "fill_defaults"]

DESCRIPTION = """\
Operate a pgbroker queue: inspect jobs, handle dead letters, pause queues, sweep, serve the admin
page and Prometheus metrics. Exit status: 0 done, 1 database unreachable or schema not migrated,
2 usage error or an action that cannot be done (bad id, unknown queue, job in the wrong state);
health: 3 stale, 4 missing."""


def common_options(suppress: bool) -> argparse.ArgumentParser:
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
    common = common_options(suppress=True)
    parser = argparse.ArgumentParser(prog="pgbroker", description=DESCRIPTION,
                                     parents=[common_options(suppress=False)])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, func: Callable[..., Any], help: str,
                where: Any = sub) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = where.add_parser(name, help=help, description=help,
                                                      parents=[common])
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
                       help=f"{text}, for a consumer row without a lease of its own (one "
                            "an older pgbroker registered; every other is judged by its own; "
                            f"default: the lease_timeout option, {d.lease_timeout:g})")

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
    p = command("list", with_ops(cmd_jobs_list), "List the newest jobs, optionally filtered.",
                jobs_sub)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--state", choices=JOB_STATES, help="only this state")
    p.add_argument("--task", help="only this task name")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p = command("show", with_ops(cmd_jobs_show), "Show one job in full: state, attempts, error "
                "and traceback, headers, decoded body.", jobs_sub)
    p.add_argument("id", metavar="ID", help="job id, Celery task id, or idempotency key")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    dead = sub.add_parser("dead", help="Dead letters: list, retry, discard.",
                          description="Dead letters: jobs that failed for good, out of attempts, "
                          "or rejected. Poison jobs (their consumer was lost during every "
                          "attempt) are marked.", parents=[common])
    dead_sub = dead.add_subparsers(dest="dead_command", metavar="ACTION", required=True)
    p = command("list", with_ops(cmd_dead_list), "List dead jobs, most recent first.", dead_sub)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    for action, text in (("retry", "Put dead jobs back to pending with their attempts reset to "
                                   "0 (their last error is kept in the audit log); workers pick "
                                   "them up at once."),
                         ("discard", "Delete dead jobs for good (the audit log keeps their "
                                     "queue, task, error and traceback).")):
        p = command(action, with_ops(dead_action(action)), text, dead_sub)
        p.add_argument("id", metavar="ID", nargs="?", help="the dead job's id")
        p.add_argument("--all", action="store_true", help="every dead job (of --queue)")
        p.add_argument("--queue", help="with --all: only this queue")
        p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                       help=f"jobs per transaction with --all (default: {DEFAULT_BATCH_SIZE})")

    p = command("cancel", with_ops(cmd_cancel), "Cancel a pending or scheduled job: it will "
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

    p = command("purge", with_ops(cmd_purge), "Delete every pending and scheduled job of a "
                "queue, in batches with progress (running jobs finish; dead ones stay).")
    p.add_argument("queue", metavar="QUEUE")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"jobs per transaction (default: {DEFAULT_BATCH_SIZE})")

    p = command("pause", with_ops(cmd_pause), "Pause a queue: no worker claims its jobs until "
                "it is resumed (jobs already running finish; publishing goes on).")
    p.add_argument("queue", metavar="QUEUE")
    p = command("resume", with_ops(cmd_resume), "Resume a paused queue; its workers are woken "
                "at once.")
    p.add_argument("queue", metavar="QUEUE")

    queues = sub.add_parser("queues", help="Queue maintenance.", description="Queue "
                            "maintenance.", parents=[common])
    queues_sub = queues.add_subparsers(dest="queues_command", metavar="ACTION", required=True)
    p = command("prune", with_ops(cmd_queues_prune), "Delete the queues nobody uses: no "
                "pending, scheduled or dead job, no consumer, not paused, not declared for "
                "--idle seconds; with their bindings, and the exchanges left without one. A "
                "queue declared again is created again.", queues_sub)
    p.add_argument("--idle", type=float, default=IDLE_QUEUE_SECONDS, metavar="SECONDS",
                   help=f"unused for this long (default: {IDLE_QUEUE_SECONDS:g}, a week)")

    p = command("audit", with_ops(cmd_audit), "Show the audit log: who did what, when.")
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
    p.add_argument("--consumer", type=consumer_id, metavar="ID",
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
    p = command("vacuum", cmd_health, "VACUUM's horizon: nothing (a transaction, a snapshot, "
                "a replication slot) has held it back longer than --max-age; the holders and "
                "the hot tables' dead row versions in the details.", checks_sub)
    p.add_argument("--max-age", type=float, default=300.0, metavar="SECONDS",
                   help="stale when held longer (default: 300)")
    p.add_argument("--max-xid-age", type=int, metavar="N", help="also stale when the held "
                   "xmin is more than N transactions old (default: not checked)")

    schedule.register(sub, parents=[common])  # schedule list|add|enable|disable|delete
    tasks.register(sub, parents=[common])  # task list|pause|resume
    return parser


#: Options whose default is a transport option (the -A app's, else pgbroker's default).
_FROM_SETTINGS = {"window": "retention", "retention": "retention",
                  "lease_timeout": "lease_timeout", "interval": "sweep_interval"}


def fill_defaults(args: argparse.Namespace, settings: Settings) -> None:
    """Give the options left unset the transport option they default to (:data:`_FROM_SETTINGS`)."""
    for option, name in _FROM_SETTINGS.items():
        if getattr(args, option, False) is None:
            setattr(args, option, getattr(settings, name))
