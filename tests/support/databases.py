"""Creating and dropping the test databases (tests/conftest.py's ``db_url`` and friends, and
the tests that need a database of a kind of their own).
"""

from __future__ import annotations

import time

import psycopg
from psycopg import sql

__all__ = ["create_database", "drop_database"]


def drop_database(maintenance_url: str, name: str) -> None:
    """Terminate the backends of ``name`` and drop it (PostgreSQL 13+ for WITH (FORCE))."""
    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def create_database(maintenance_url: str, name: str, template: str | None = None) -> None:
    """Create ``name`` (from ``template``), retrying while the template is briefly in use."""
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    deadline = time.monotonic() + 10
    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        while True:
            if template is not None:
                # CREATE DATABASE ... TEMPLATE fails while anyone is connected to the template
                # (a pool left open by the migration, say): disconnect them first.
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (template,),
                )
            try:
                conn.execute(query)
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
