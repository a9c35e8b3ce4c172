"""``python -m ticketflow``: ``demo`` (see :mod:`ticketflow.demo`) and ``migrate``."""

from __future__ import annotations

import argparse
import sys

from pgbroker.errors import ConfigurationError, PgBrokerError
from pgbroker.migrate import migrate as migrate_pgbroker

from . import db
from .demo import add_arguments
from .demo import main as demo


def _migrate(args: argparse.Namespace) -> int:
    """Migrate pgbroker's schema, then ticketflow's (what a deployment runs before starting)."""
    url = db.resolve_url(args.database_url, "ticketflow migrate")
    applied = {"pgbroker": migrate_pgbroker(url), "ticketflow": db.migrate(url)}
    for schema, versions in applied.items():
        print(f"{schema}: " + (f"applied {versions}" if versions else "up to date"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ticketflow",
        description="ticketflow, the reference application of pgbroker.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the live demo (worker, beat, a few hundred "
                                       "reservations); Ctrl-C stops it")
    add_arguments(demo)
    migrate = sub.add_parser("migrate", help="apply pgbroker's and ticketflow's migrations")
    migrate.add_argument("--database-url", metavar="URL",
                         help="PostgreSQL URL (default: PGBROKER_DATABASE_URL, else "
                              "127.0.0.1:5432)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 1 the database cannot be used (unreachable, a schema from a newer
    version, a child process died); 2 a usage error (arguments, a malformed URL)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "migrate":
            return _migrate(args)
        return demo(args)
    except ConfigurationError as exc:
        print(f"python -m ticketflow {args.command}: {exc}", file=sys.stderr)
        return 2
    except PgBrokerError as exc:
        print(f"python -m ticketflow {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
