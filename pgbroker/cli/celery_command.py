"""``celery -A proj pgbroker COMMAND ...``: pgbroker's command line as a Celery subcommand.

Installed as a Celery CLI plugin (the ``celery.commands`` entry point), which Celery's command
line loads when it starts, before it loads the app. Loading it imports :mod:`pgbroker`, which
registers the ``pgbroker://`` scheme with kombu: so ``celery -A proj worker`` (``beat``,
``inspect``, ``call``, ...) finds the transport even when nothing in the project imports
pgbroker -- a project changes ``broker_url`` and nothing else. (A process that publishes without
Celery's command line and without pgbroker's Django app must still ``import pgbroker``: see the
README's configuration snippet and docs/django.md, "The transport without an import".)

The subcommand passes ``-A`` on to ``pgbroker`` (its ``broker_url`` and transport options give
the database), unless the arguments name ``--database-url`` or ``-A`` themselves.
"""

from __future__ import annotations

from typing import Any

import click

from . import main

__all__ = ["pgbroker"]

_CHOSEN = ("--database-url", "-A", "--app")


@click.command(name="pgbroker", context_settings={"ignore_unknown_options": True,
                                                  "allow_extra_args": True,
                                                  "help_option_names": []},
               add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def pgbroker(ctx: click.Context, /, args: tuple[str, ...], **_: Any) -> None:
    """pgbroker's command line on this app's broker (celery -A proj pgbroker --help)."""
    argv = list(args)
    app = ctx.find_root().params.get("app")
    if isinstance(app, str) and not any(
            a in _CHOSEN or a.startswith(tuple(o + "=" for o in _CHOSEN)) for a in argv):
        argv = ["-A", app, *argv]
    ctx.exit(main(argv))
