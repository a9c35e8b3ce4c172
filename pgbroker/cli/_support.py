"""What every ``pgbroker`` command shares: which database (:func:`target`), a checked
connection (:func:`connect`, :func:`with_ops`), and the output helpers (tables, JSON, progress).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import closing
from datetime import datetime
from typing import Any

import psycopg
from celery.app.utils import find_app

from .._celery.app import broker_of
from .._pg import driver as _db
from .._pg.local_server import DEFAULT_LOCAL_URL, ENV_DATABASE_URL
from ..errors import ConfigurationError
from ..migrate import check
from ..ops import Operations, os_user
from ..settings import Settings

__all__ = ["Target", "connect", "fmt", "first_line", "progress", "table", "target", "to_json",
           "url_of", "with_ops"]


# -- output helpers ------------------------------------------------------------------------------

def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def first_line(text: str | None, width: int = 60) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= width else line[:width - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def to_json(data: Any) -> str:
    def default(value: Any) -> Any:
        if isinstance(value, (bytes, memoryview)):
            return None  # bodies are shown by `jobs show`, decoded
        if isinstance(value, datetime):
            return value.isoformat()
        return str(value)

    return json.dumps(data, indent=2, default=default, ensure_ascii=False)


def progress(verb: str) -> Callable[[int, int], None]:
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
    except Exception as exc:
        raise ConfigurationError(f"cannot load the Celery app {name!r}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    broker = broker_of(app, name)
    return broker.conninfo, broker.shown, broker.settings


def url_of(args: argparse.Namespace) -> str:
    url: str = args.database.url
    return url


def connect(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """A connection to a migrated schema (or :class:`SchemaError` saying to migrate)."""
    Settings(schema=args.schema)
    conn = _db.connect(url_of(args), application_name="pgbroker cli")
    try:
        with _db.translate_errors("checking the pgbroker schema"):
            check(conn, args.schema)
    except BaseException:
        _db.close(conn)
        raise
    return conn


def with_ops(handler: Callable[[Operations, argparse.Namespace], int | None]
              ) -> Callable[[argparse.Namespace], int | None]:
    def run(args: argparse.Namespace) -> int | None:
        with closing(connect(args)) as conn:
            return handler(Operations(conn, args.schema, actor=os_user(), via="cli"), args)

    return run
