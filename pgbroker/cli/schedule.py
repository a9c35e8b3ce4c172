"""``pgbroker schedule list|add|enable|disable|delete``: beat's schedule from the command line.

Each action goes through :class:`pgbroker.schedules.Schedules` (audited, with the operating-system
user as the actor); errors follow the other commands: :class:`~pgbroker.errors.OperationError`
(exit 2) for a mistake, :class:`~pgbroker.errors.DatabaseUnavailable` (exit 1) for the database.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from contextlib import closing
from typing import Any

from celery import schedules as celery_schedules

from .._model.schedule import MISFIRE_POLICIES, OVERLAP_POLICIES
from ..errors import OperationError
from ..ops import os_user
from ..schedules import Schedules
from ._support import connect, table, to_json

__all__ = ["register"]


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """Add ``schedule list|add|enable|disable|delete`` to the ``pgbroker`` command line.

    ``parents``: the parser(s) giving ``--database-url`` and ``--schema`` after the command.
    """
    parents = list(parents)
    text = "Beat's periodic schedule: list entries, add or change one, enable, disable, delete."
    top = subparsers.add_parser("schedule", help=text, description=text, parents=parents)
    sub = top.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)

    def action(name: str, func: Callable[[Schedules, argparse.Namespace], int],
               help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help,
                                                    parents=parents)
        p.set_defaults(func=_with_schedules(func))
        return p

    p = action("list", _cmd_list, "List the entries: schedule, next and last occurrence, runs, "
               "the last job's state and when a run last completed.")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    for verb, func, help in (
            ("enable", _cmd_enable, ("Enable an entry: beats fire it again from their next tick "
                                     "(missed occurrences follow its misfire policy).")),
            ("disable", _cmd_disable, ("Disable an entry: beats stop firing it at their next "
                                       "tick; kept across restarts until enabled.")),
            ("delete", _cmd_delete, ("Delete an entry added at run time, or one removed from "
                                     "the beat_schedule config."))):
        action(verb, func, help).add_argument("name", metavar="NAME")
    p = action("add", _cmd_add, "Add an entry at run time (or change one with --replace); "
               "beats pick it up at their next tick.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("task", metavar="TASK", help="the Celery task name")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--every", type=float, metavar="SECONDS",
                      help="an interval, on multiples of it counted from the Unix epoch")
    when.add_argument("--crontab", metavar="'M H DOM MON DOW'",
                      help="a crontab expression, e.g. '*/15 * * * *'")
    p.add_argument("--tz", default="UTC", help="the crontab's time zone (default: UTC)")
    p.add_argument("--args", default="[]", metavar="JSON", help="positional arguments, a JSON "
                   "list")
    p.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments, a JSON "
                   "object")
    p.add_argument("--queue", help="queue (default: the app's routing)")
    p.add_argument("--priority", type=int, help="priority, 0-255 (higher first)")
    p.add_argument("--expires", type=float, metavar="SECONDS",
                   help="discard a job not started this long after it was sent")
    p.add_argument("--misfire", choices=MISFIRE_POLICIES, default="latest",
                   help="after downtime: fire once (latest, default) or wait (skip)")
    p.add_argument("--overlap", choices=OVERLAP_POLICIES, default="skip",
                   help="while the previous run is unfinished: skip (default), queue or allow")
    p.add_argument("--disabled", action="store_true", help="add it disabled")
    p.add_argument("--replace", action="store_true", help="change the entry if it exists")


def _with_schedules(handler: Callable[[Schedules, argparse.Namespace], int]
                    ) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with closing(connect(args)) as conn:
            return handler(Schedules(conn, args.schema, actor=os_user(), via="cli"), args)

    return run


def _cmd_list(schedules: Schedules, args: argparse.Namespace) -> int:
    rows = schedules.list()
    if args.json:
        print(to_json(rows))
        return 0

    def state(row: dict[str, Any]) -> str:
        if row["removed_at"] is not None:
            return "removed"
        return "enabled" if row["enabled"] else "disabled"

    print(table(["NAME", "TASK", "SCHEDULE", "STATE", "NEXT", "LAST", "RUNS", "LAST JOB",
                  "COMPLETED AGO", "POLICIES", "ERROR"],
                 [[r["name"], r["task"], r["schedule"], state(r), r["next_occurrence"],
                   r["last_occurrence"], r["total_runs"], r["last_job_state"],
                   None if r["age_seconds"] is None else f"{r['age_seconds']:.0f}s",
                   f"misfire {r['misfire']}, overlap {r['overlap']}",
                   (r["last_error"] or "")[:60]] for r in rows]))
    return 0


def _cmd_enable(schedules: Schedules, args: argparse.Namespace) -> int:
    changed = schedules.set_enabled(args.name, True)
    print(f"schedule entry {args.name} {'enabled' if changed else 'was already enabled'}")
    return 0


def _cmd_disable(schedules: Schedules, args: argparse.Namespace) -> int:
    changed = schedules.set_enabled(args.name, False)
    print(f"schedule entry {args.name} {'disabled' if changed else 'was already disabled'}")
    return 0


def _cmd_delete(schedules: Schedules, args: argparse.Namespace) -> int:
    schedules.delete(args.name)
    print(f"schedule entry {args.name} deleted")
    return 0


def _cmd_add(schedules: Schedules, args: argparse.Namespace) -> int:
    parsed = {}
    for key in ("args", "kwargs"):
        try:
            parsed[key] = json.loads(getattr(args, key))
        except ValueError as exc:
            raise OperationError(f"--{key} is not JSON: {exc}") from None
    if args.crontab is not None:
        fields = args.crontab.split()
        if len(fields) != 5:
            raise OperationError(f"--crontab needs 5 fields (minute hour day-of-month month "
                                 f"day-of-week), not {args.crontab!r}")
        try:
            # crontab.from_string came with Celery 5.5: the fields by name, in cron's order
            minute, hour, day_of_month, month_of_year, day_of_week = fields
            schedule: Any = celery_schedules.crontab(
                minute=minute, hour=hour, day_of_month=day_of_month,
                month_of_year=month_of_year, day_of_week=day_of_week)
        except (ValueError, celery_schedules.ParseException) as exc:
            raise OperationError(f"invalid --crontab {args.crontab!r}: {exc}") from None
    else:
        schedule = args.every
    options = {k: getattr(args, k) for k in ("queue", "priority", "expires")
               if getattr(args, k) is not None}
    outcome = schedules.add(args.name, args.task, schedule, parsed["args"], parsed["kwargs"],
                            {**options, "misfire": args.misfire, "overlap": args.overlap},
                            tz=args.tz, enabled=not args.disabled, replace=args.replace)
    print(f"schedule entry {args.name} {outcome}")
    return 0
