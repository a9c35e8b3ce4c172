"""The admin web app (Flask): its factory, :func:`create_app`, which checks the schema, opens
the connection pool and installs the guards (:mod:`.guards`), the template filters
(:mod:`.present`) and the pages (:mod:`.pages`: state; :mod:`.jobs`: jobs and actions).

Server-rendered Jinja2 pages (autoescaped: no job payload, task name or error is ever rendered
as markup), charts drawn as inline SVG on the server (:mod:`.charts`), htmx polling the parts
that change; every action is a plain POST form that goes through :class:`pgbroker.ops.Operations`
(or :class:`pgbroker.beat.Schedules`), the same code as the CLI, with the logged-in user as the
actor. Requests borrow a connection from a small psycopg pool for their duration.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from flask import Flask
from psycopg_pool import ConnectionPool

from .._pg import driver as _db
from .._pg.catalogue import Queries
from ..metrics import MetricsReader, prometheus_registry
from ..migrate import check as check_schema
from ..settings import Settings
from . import guards, jobs, pages
from .auth import ENV_SECRET, ENV_SECURE_COOKIE, Credentials, LoginThrottle
from .present import install_filters
from .state import AdminState

__all__ = ["create_app"]


def create_app(database_url: str, schema: str = "pgbroker", credentials: Credentials | None = None,
               *, refresh: float = 3.0, window: float | None = None,
               lease_timeout: float | None = None, secret_key: str | bytes | None = None,
               pool_size: int = 4, secure_cookie: bool | None = None,
               throttle: LoginThrottle | None = None, trust_environ: bool = False) -> Flask:
    """The admin app for ``schema`` in ``database_url``; checks the schema first.

    ``secure_cookie``: send the session cookie over HTTPS only (default:
    ``PGBROKER_ADMIN_SECURE_COOKIE``). ``trust_environ``: the app is mounted in a server that
    logs people in itself and says who in the WSGI environ (:data:`.guards.TRUSTED_LOGIN`;
    pgbroker's Django app does), so it needs no credentials of its own. Call
    ``app.extensions["pgbroker"].close()`` when done (``serve`` does).
    """
    credentials = credentials or Credentials.from_env()
    if not credentials.configured and not trust_environ:
        raise ValueError("the admin page needs credentials (see pgbroker.admin.auth)")
    Settings(schema=schema)  # validates the name
    conninfo = _db.libpq_url(database_url)
    conn = _db.connect(conninfo, application_name="pgbroker admin")
    try:
        with _db.translate_errors("checking the pgbroker schema"):
            check_schema(conn, schema)
    finally:
        _db.close(conn)
    if secure_cookie is None:
        secure_cookie = os.environ.get(ENV_SECURE_COOKIE, "").lower() in ("1", "true", "yes")

    app = Flask(__name__)
    app.config.update(
        SECRET_KEY=secret_key or os.environ.get(ENV_SECRET) or secrets.token_bytes(32),
        # __Host-: a cookie the browser keeps only from HTTPS, for this host, for every path
        SESSION_COOKIE_NAME="__Host-pgbroker_admin" if secure_cookie else "pgbroker_admin",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=secure_cookie,
        MAX_CONTENT_LENGTH=64 * 1024,
    )
    q = Queries(schema)

    def configure(conn: Any) -> None:  # each connection the pool opens
        q.execute(conn, "admin_connection_setup")

    # prepare_threshold None: every statement is planned with its values, so a state or queue
    # given as a parameter still picks its partial index (a generic plan cannot).
    pool = ConnectionPool(conninfo, min_size=1, max_size=pool_size, timeout=10,
                          name="pgbroker-admin", open=True,
                          kwargs={"autocommit": True, "prepare_threshold": None,
                                  **_db.connect_kwargs("pgbroker admin")},
                          configure=configure)
    reader = MetricsReader(schema, window=window, lease_timeout=lease_timeout)
    state = AdminState(pool, schema, credentials, reader, refresh, None,
                       throttle or LoginThrottle(), q, reader.lease_timeout)
    state.registry = prometheus_registry(state.snapshot)
    state.trust_environ = trust_environ
    app.extensions["pgbroker"] = state
    guards.install(app)
    install_filters(app)
    pages.install(app)
    jobs.install(app)
    return app
