"""A Django database's psycopg connection and conninfo.

Django (4.2 and later, with psycopg 3 installed) runs on a psycopg 3 connection,
``connection.connection``: :func:`driver_connection` returns it (pgbroker writes on it in
whatever transaction Django has open: :mod:`pgbroker._produce.connectors.django_connection`).
:func:`alias_conninfo` is the database a ``pgbroker+django://ALIAS`` broker URL names.
:mod:`pgbroker.contrib.django` is the user-facing API.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

__all__ = ["alias_conninfo", "conninfo_of", "driver_connection"]


def driver_connection(db: Any) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under a Django connection (``django.db.connection`` or
    ``django.db.connections[alias]``).

    Opens the Django connection if it is not open yet (as Django's own first query would).

    Raises:
        TypeError: ``db`` is not a Django connection, or not PostgreSQL on psycopg 3.
    """
    # Django is optional (a test dependency of pgbroker, never a runtime one): imported only
    # when a Django connection is used.
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(db, ConnectionProxy):  # django.db.connection: this thread's "default"
        db = connections[db.alias]
    if not isinstance(db, BaseDatabaseWrapper):
        raise TypeError(f"expected a Django database connection (django.db.connections[...]), "
                        f"not {type(db).__module__}.{type(db).__name__}")
    if db.vendor != "postgresql":
        raise TypeError(f"pgbroker needs PostgreSQL, but Django database {db.alias!r} is "
                        f"{db.vendor} ({db.settings_dict.get('ENGINE')})")
    db.ensure_connection()
    raw = db.connection
    if not isinstance(raw, psycopg.Connection):
        raise TypeError(
            f"pgbroker needs the psycopg 3 driver, but Django database {db.alias!r} runs on "
            f"{type(raw).__module__}: install psycopg 3 (`pip install psycopg`), which Django "
            "4.2 and later prefer to psycopg2")
    return raw


def conninfo_of(db: Any) -> str:
    """A libpq conninfo for Django database connection ``db`` (its ``settings_dict`` as Django
    connects with it: under ``manage.py test``, the test database)."""
    params = db.get_connection_params()
    return make_conninfo(**{key: str(params[key]) for key in
                            ("dbname", "user", "password", "host", "port") if params.get(key)})


def alias_conninfo(alias: str) -> str:
    """The conninfo of Django database ``alias``: what ``pgbroker+django://ALIAS`` names."""
    # Django is optional: imported only for a broker URL that names a Django database
    from django.db import connections

    if alias not in connections:
        raise TypeError(f"pgbroker+django://{alias}: Django has no database {alias!r} "
                        f"(DATABASES names {', '.join(map(repr, connections))})")
    return conninfo_of(connections[alias])
