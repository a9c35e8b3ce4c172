"""ticketflow's database: the broker's database, one SQLAlchemy engine per process and URL.

Why the broker's database: a job is written in the transaction that changes the row it is about
(``pgbroker.enqueue(session, ...)``), so ``ticketflow.*`` and ``pgbroker.jobs`` must live in the
same database. The URL therefore comes from the Celery app's ``broker_url`` (set in
``celeryconfig.py`` from ``PGBROKER_DATABASE_URL``), and the app's tables stay apart in their own
schema, ``ticketflow``, versioned by pgbroker's migration runner.

Engines are cached per process id: a prefork pool child never reuses the connections of the
parent it was forked from (two processes on one socket corrupt both sessions).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from pgbroker._pg import driver as _db
from pgbroker._pg.driver import mask_password
from pgbroker._pg.local_server import admin_url, normalize_url, resolve_database_url
from pgbroker.errors import ConfigurationError, DatabaseUnavailable
from pgbroker.migrate import apply, load

from . import app as celery_app
from .models import SCHEMA

__all__ = ["create_database", "database_url", "dispose", "drop_database", "engine", "migrate",
           "resolve_url", "session"]

#: The comment the demo puts on its database: only a database carrying it is ever replaced.
DEMO_MARK = "made by python -m ticketflow demo; dropped at its end unless --keep"

_engines: dict[tuple[int, str], Engine] = {}
_lock = threading.Lock()


def database_url(app: Any = None) -> str:
    """The libpq URL (``postgresql://``) of the Celery app's broker database.

    ``app`` defaults to ``ticketflow.app``.
    """
    return normalize_url(str((celery_app if app is None else app).conf.broker_url))


def resolve_url(url: str | None = None, purpose: str = "ticketflow") -> str:
    """``url`` (any accepted form), else the server this machine offers
    (``PGBROKER_DATABASE_URL``, 127.0.0.1:5432, or an embedded server started now: see
    :func:`pgbroker._pg.local_server.resolve_database_url`), as a ``postgresql://`` URL.

    Raises:
        ConfigurationError: the URL is not a PostgreSQL URL.
        DatabaseUnavailable: no server, and the embedded one cannot be started.
    """
    try:
        return normalize_url(url) if url else resolve_database_url(purpose)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from exc
    except RuntimeError as exc:
        raise DatabaseUnavailable(str(exc)) from exc


def create_database(server_url: str, name: str) -> str:
    """Create the database ``name`` on the server of ``server_url`` and return its URL.

    A database of that name left by an earlier run (``--keep``) is replaced; any other one of
    that name is refused, and so is one in use (another demo running).

    Raises:
        ConfigurationError: the name is taken, or the role may not create databases.
        DatabaseUnavailable: the server cannot be reached.
    """
    ident = sql.Identifier(name)
    with _maintenance(server_url) as conn:
        row = conn.execute("SELECT shobj_description(oid, 'pg_database') FROM pg_database"
                           " WHERE datname = %s", (name,)).fetchone()
        try:
            if row is not None:
                if row[0] != DEMO_MARK:
                    raise ConfigurationError(f"database {name!r} exists and the demo did not "
                                             "make it: pass --database with another name")
                conn.execute(sql.SQL("DROP DATABASE {}").format(ident))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
            conn.execute(sql.SQL("COMMENT ON DATABASE {} IS {}").format(ident,
                                                                       sql.Literal(DEMO_MARK)))
        except psycopg.errors.ObjectInUse:
            raise ConfigurationError(f"database {name!r} is in use (another demo running?): "
                                     "stop it, or pass --database with another name") from None
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ConfigurationError(f"cannot create database {name!r} on "
                                     f"{mask_password(server_url)}: {exc}".strip()) from None
    return admin_url(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    """Drop the demo's database ``name`` (its sessions are ended: PostgreSQL 13+)."""
    with _maintenance(server_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def _maintenance(server_url: str) -> psycopg.Connection[Any]:
    return _db.connect(server_url, application_name="ticketflow demo")  # DatabaseUnavailable


def engine(url: str | None = None) -> Engine:
    """This process's engine for ``url`` (default: :func:`database_url`).

    Any libpq URL works, including the embedded server's unix-socket form
    (``postgresql://postgres@/postgres?host=/tmp/...&port=...``): it is handed to psycopg as
    connection parameters rather than re-parsed by SQLAlchemy.
    """
    url = normalize_url(url) if url else database_url()
    key = (os.getpid(), url)
    with _lock:
        found = _engines.get(key)
        if found is None:
            found = _engines[key] = create_engine(
                "postgresql+psycopg://",
                connect_args={**psycopg.conninfo.conninfo_to_dict(url),
                              "application_name": "ticketflow"},
                pool_size=2, max_overflow=8, pool_pre_ping=True)
        return found


def session(url: str | None = None) -> Session:
    """A new session on :func:`engine` (``expire_on_commit=False``: objects stay readable)."""
    return Session(engine(url), expire_on_commit=False)


def migrate(url: str) -> list[int]:
    """Apply ticketflow's pending migrations to its schema in ``url``; return the versions
    applied (numbered SQL files, one transaction, under pgbroker's advisory lock)."""
    return apply(normalize_url(url), SCHEMA, load("ticketflow", "migrations"), what="ticketflow")


def dispose() -> None:
    """Close every engine this process made (tests drop their databases afterwards)."""
    with _lock:
        engines = [e for (pid, _), e in _engines.items() if pid == os.getpid()]
        _engines.clear()
    for found in engines:
        found.dispose()
