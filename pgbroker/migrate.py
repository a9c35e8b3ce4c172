"""Schema migrations: numbered SQL files applied in one transaction under an advisory lock.

``sql/migrations/NNNN_name.sql`` are applied in order and recorded in ``<schema>.migrations``.
The lock makes concurrent first starts of many processes safe: one applies, the others wait and
then find nothing to do. A schema migrated by a newer pgbroker is refused, not downgraded.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg

from ._pg import driver as _db
from .errors import SchemaError
from .settings import Settings

__all__ = ["migrate", "migrate_once", "connect_ready", "check", "apply", "apply_on", "load",
           "Migration", "MIGRATIONS", "latest_version", "LOCK_TIMEOUT"]

logger = logging.getLogger(__name__)

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load(package: str, folder: str) -> tuple[Migration, ...]:
    """The numbered ``NNNN_name.sql`` files of ``package``/``folder``, checked to be 1..n."""
    found = []
    root = resources.files(package)
    for part in folder.split("/"):
        root = root.joinpath(part)
    for entry in root.iterdir():
        match = _FILE_RE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations are not numbered 1..n: {[m.version for m in found]}")
    return tuple(found)


MIGRATIONS = load("pgbroker", "sql/migrations")


def latest_version() -> int:
    return MIGRATIONS[-1].version


def _lock_key(schema: str) -> str:
    return f"pgbroker.migrate.{schema}"


#: Seconds a migration waits for another's advisory lock (any role that can connect can take
#: it, and hold it for ever) before it gives up with a SchemaError that says who holds it.
LOCK_TIMEOUT = 60.0


def migrate(conninfo: str, schema: str = "pgbroker",
            lock_timeout: float = LOCK_TIMEOUT) -> list[int]:
    """Apply pgbroker's pending migrations to ``schema``; return the versions applied."""
    Settings(schema=schema)  # validates the name
    return apply(conninfo, schema, MIGRATIONS, what="pgbroker", lock_timeout=lock_timeout)


_migrated: set[tuple[str, str]] = set()
_migrated_lock = threading.Lock()


def migrate_once(conninfo: str, schema: str) -> None:
    """:func:`migrate`, once per process and (database, schema)."""
    key = (conninfo, schema)
    if key in _migrated:
        return
    with _migrated_lock:
        if key not in _migrated:
            migrate(conninfo, schema)
            _migrated.add(key)


def connect_ready(conninfo: str, settings: Settings, *, application_name: str, what: str,
                  setup: Callable[[psycopg.Connection[Any]], object] | None = None
                  ) -> psycopg.Connection[Any]:
    """Open a connection to a schema at this version: migrated first (once per process) with
    ``auto_migrate``, else checked (:class:`SchemaError` if it is not); then ``setup`` (session
    settings). Errors are translated as ``what``; the connection is closed again if any of it
    fails. The store, beat and the lease open theirs here."""
    if settings.auto_migrate:
        migrate_once(conninfo, settings.schema)
    conn = _db.connect(conninfo, connect_timeout=settings.connect_timeout,
                       application_name=application_name)
    try:
        with _db.translate_errors(what):
            if not settings.auto_migrate:
                check(conn, settings.schema)
            if setup is not None:
                setup(conn)
    except BaseException:
        _db.close(conn)
        raise
    return conn


def apply(conninfo: str, schema: str, migrations: tuple[Migration, ...],
          what: str = "pgbroker", lock_timeout: float = LOCK_TIMEOUT) -> list[int]:
    """Apply ``migrations`` (from :func:`load`) to ``schema``, in one transaction under an
    advisory lock, recording them in ``<schema>.migrations``; return the versions applied.

    Applications can version their own schema with it (ticketflow does)."""
    ident = f'"{schema}"'
    conn = _db.connect(conninfo, autocommit=False, application_name=f"{what} migrate")
    try:
        # Up to date already: no lock and no DDL, so an application role without CREATE on the
        # database (see docs/security.md) can start with auto_migrate on.
        with _db.translate_errors(f"checking the {what} schema"), conn.transaction():
            if conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                            (f"{ident}.migrations",)).fetchone()[0]:  # type: ignore[index]
                done = {r[0] for r in conn.execute(f"SELECT version FROM {ident}.migrations")}
                _refuse_newer(done, schema, migrations[-1].version, what)
                if all(m.version in done for m in migrations):
                    return []
        with _db.translate_errors(f"migrating the {what} schema"), conn.transaction():
            return apply_on(conn, schema, migrations, what, lock_timeout)
    finally:
        _db.close(conn)


def apply_on(conn: psycopg.Connection[Any], schema: str, migrations: tuple[Migration, ...],
             what: str = "pgbroker", lock_timeout: float = LOCK_TIMEOUT) -> list[int]:
    """:func:`apply` in the transaction open on ``conn`` (the caller commits): Django's
    ``migrate`` runs pgbroker's migrations this way, in the transaction of its own migration."""
    ident = f'"{schema}"'
    _take_lock(conn, schema, lock_timeout, what)
    conn.execute(f"CREATE SCHEMA IF NOT EXISTS {ident}")
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {ident}.migrations ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    done = {row[0] for row in conn.execute(f"SELECT version FROM {ident}.migrations")}
    _refuse_newer(done, schema, migrations[-1].version, what)
    applied = []
    for m in migrations:
        if m.version in done:
            continue
        logger.info("applying %s migration %04d_%s to schema %s", what, m.version, m.name, schema)
        conn.execute(m.sql.replace("{schema}", ident).encode())
        conn.execute(f"INSERT INTO {ident}.migrations (version, name) VALUES (%s, %s)",
                     (m.version, m.name))
        applied.append(m.version)
    return applied


def _take_lock(conn: psycopg.Connection[Any], schema: str, timeout: float, what: str) -> None:
    """The migration's advisory lock, for this transaction; SchemaError after ``timeout``."""
    key = _lock_key(schema)
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not conn.execute("SELECT pg_try_advisory_xact_lock(hashtext(%s))",
                           (key,)).fetchone()[0]:  # type: ignore[index]
        if time.monotonic() >= deadline:
            holders = conn.execute(
                "SELECT a.pid, a.usename, a.application_name, a.state FROM pg_locks AS l"
                " JOIN pg_stat_activity AS a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
                "   AND l.database = (SELECT oid FROM pg_database"
                "                     WHERE datname = current_database())"
                "   AND l.objid = (hashtext(%s)::bigint & 4294967295)::oid", (key,)).fetchall()
            who = ", ".join(f"pid {pid} ({user}, {app!r}, {state})"
                            for pid, user, app, state in holders) or "another session"
            raise SchemaError(
                f"the {what} migration lock of schema {schema!r} is held by {who} for more "
                f"than {timeout:g} s: another migration is running, or that session holds it "
                "without one (end it with pg_terminate_backend if so), then migrate again")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def check(conn: psycopg.Connection[Any], schema: str) -> None:
    """Raise :class:`SchemaError` unless ``schema`` is migrated to exactly this version."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".migrations',)
    ).fetchone()
    if not row or not row[0]:
        raise SchemaError(
            f"the pgbroker schema {schema!r} does not exist in this database: run "
            f"`pgbroker migrate` (or enable the auto_migrate transport option)"
        )
    done = {r[0] for r in conn.execute(f'SELECT version FROM "{schema}".migrations')}
    _refuse_newer(done, schema, latest_version(), "pgbroker")
    missing = [m.version for m in MIGRATIONS if m.version not in done]
    if missing:
        raise SchemaError(
            f"the pgbroker schema {schema!r} lacks migrations {missing}: run `pgbroker migrate`"
        )


def _refuse_newer(done: set[int], schema: str, latest: int, what: str) -> None:
    newer = sorted(v for v in done if v > latest)
    if newer:
        raise SchemaError(
            f"the {what} schema {schema!r} was migrated by a newer {what} (versions {newer}; "
            f"this one knows up to {latest}): upgrade {what} on this host"
        )
