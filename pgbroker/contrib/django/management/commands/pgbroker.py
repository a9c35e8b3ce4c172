"""``manage.py pgbroker COMMAND ...``: pgbroker's command line on the project's broker.

Every ``pgbroker`` command (``stats``, ``dead``, ``jobs``, ``task``, ``schedule``, ``serve``,
``health``, ``migrate``, ...) with its own options and exit status; ``manage.py pgbroker --help``
lists them. The database and the schema are the project's pgbroker broker: the Celery app named
by ``PGBROKER_CELERY_APP``, else ``CELERY_BROKER_URL`` and ``CELERY_BROKER_TRANSPORT_OPTIONS``
(:mod:`pgbroker.contrib.django.celery_app`), else (no pgbroker broker) ``DATABASES["default"]``.
``--database-url`` or ``-A`` on the command line win. No system checks run first, so
``manage.py pgbroker migrate`` mends what ``pgbroker.E001`` reports.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from django.conf import settings as django_settings
from django.core.management.base import BaseCommand, CommandError

from .....cli import main
from ... import conf

__all__ = ["Command", "cli_argv"]

_CHOSEN = ("--database-url", "-A", "--app")


def cli_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the project's database or Celery app in front (see the module docstring)."""
    argv = list(argv)
    if any(a in _CHOSEN or a.startswith(tuple(o + "=" for o in _CHOSEN)) for a in argv):
        return argv
    named = getattr(django_settings, "PGBROKER_CELERY_APP", None)
    if named:
        return ["-A", named, *argv]
    if conf.broker() is not None:
        return ["-A", "pgbroker.contrib.django.celery_app", *argv]
    return ["--database-url", "pgbroker+django://default", *argv]


class Command(BaseCommand):
    help = ("pgbroker's command line (stats, dead, jobs, task, schedule, serve, health, "
            "migrate, ...) on the project's broker: manage.py pgbroker --help")
    requires_system_checks: Any = []
    requires_migrations_checks = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER, help="a pgbroker command")

    def run_from_argv(self, argv: list[str]) -> None:
        # pgbroker's own parser reads every argument (Django's would take --help, -v, ...)
        sys.exit(main(cli_argv(argv[2:])))

    def handle(self, *args: str, **options: Any) -> None:
        status = main(cli_argv(args))
        if status:
            raise CommandError(f"pgbroker exited with status {status}", returncode=status)
