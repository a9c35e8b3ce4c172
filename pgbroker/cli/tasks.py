"""``pgbroker task list|pause|resume``: task names paused -- by pgbroker itself, after
``pause_task_after`` deliveries in a row killed their pool process, or after its deliveries took
down that many different workers (none told to stop), or by an operator.

Each action goes through :class:`pgbroker.ops.Operations` (audited, with the operating-system
user as the actor and ``--reason`` as why).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ..ops import Operations
from ._support import first_line, table, to_json, with_ops

__all__ = ["register"]


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """Add ``task list|pause|resume`` to the ``pgbroker`` command line."""
    parents = list(parents)
    text = ("Task names paused (no worker claims their jobs): by pgbroker when deliveries in a "
            "row killed their pool process, or took down different workers none of which was "
            "told to stop (pause_task_after), or by hand. List, pause, resume.")
    top = subparsers.add_parser("task", help=text, description=text, parents=parents)
    sub = top.add_subparsers(dest="task_command", metavar="ACTION", required=True)
    p = sub.add_parser("list", help="The paused task names (why, by whom, the jobs that caused "
                       "it, how many jobs wait), and the streaks of lost deliveries under way.",
                       parents=parents)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=with_ops(_cmd_list))
    for verb, func, help in (
            ("pause", _cmd_pause, "Pause a task name: no worker claims its jobs (they wait, "
                                  "pending; running ones finish) until it is resumed."),
            ("resume", _cmd_resume, "Resume a paused task name: its waiting jobs run again "
                                    "(workers are woken at once).")):
        p = sub.add_parser(verb, help=help, description=help, parents=parents)
        p.add_argument("task", metavar="NAME", help="the Celery task name (module.function)")
        p.add_argument("--reason", default="", help="why (kept in the audit log)")
        p.set_defaults(func=with_ops(func))


def _cmd_list(ops: Operations, args: argparse.Namespace) -> int:
    paused, streaks = ops.paused_tasks(), ops.loss_streaks()
    if args.json:
        print(to_json({"paused": paused, "streaks": streaks}))
        return 0
    print(table(["TASK", "PAUSED AT", "BY", "WAITING", "REASON", "JOBS THAT CAUSED IT"],
                [[r["task"], r["paused_at"], r["paused_by"], r["waiting"],
                  first_line(r["reason"]), " ".join(map(str, r["job_ids"])) or "-"]
                 for r in paused]) if paused else "no paused task")
    if streaks:
        print("\nlosses that point to the task, in a row (not paused yet):")
        print(table(["TASK", "POOL PROCESSES KILLED", "WORKERS TAKEN DOWN", "LAST", "JOBS"],
                    [[r["task"], r["streak"], " ".join(r["workers"]) or "-", r["last_at"],
                      " ".join(map(str, r["job_ids"]))] for r in streaks]))
    return 0


def _cmd_pause(ops: Operations, args: argparse.Namespace) -> int:
    changed = ops.pause_task(args.task, args.reason)
    print(f"task {args.task} {'paused' if changed else 'was already paused'}")
    return 0


def _cmd_resume(ops: Operations, args: argparse.Namespace) -> int:
    changed = ops.resume_task(args.task, args.reason)
    print(f"task {args.task} {'resumed' if changed else 'was not paused'}")
    return 0
