"""``pgbroker``: the operator's command line (also ``python -m pgbroker``); :func:`main` runs it.

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

The package: :mod:`~pgbroker.cli.parser` (the commands and their options),
:mod:`~pgbroker.cli.commands` (their handlers), :mod:`~pgbroker.cli.schedule` (``schedule ...``)
and :mod:`~pgbroker.cli._support` (the database a command uses, output helpers).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import psycopg

from ..errors import (
    ConfigurationError,
    DatabaseUnavailable,
    OperationError,
    PgBrokerError,
    SchemaError,
)
from ._support import target
from .parser import build_parser, fill_defaults

__all__ = ["main", "build_parser"]

EXIT_FAILURE = 1
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.database = target(args)
        args.schema = args.database.schema
        fill_defaults(args, args.database.settings)
        print(args.database.describe(), file=sys.stderr, flush=True)
        return args.func(args) or 0
    except (OperationError, ConfigurationError, ValueError) as exc:
        print(f"pgbroker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (DatabaseUnavailable, SchemaError, psycopg.OperationalError) as exc:
        # (a statement that failed on a living connection: a timeout, a full disk)
        print(f"pgbroker: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except PgBrokerError as exc:
        print(f"pgbroker: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("pgbroker: interrupted", file=sys.stderr)
        return 130

