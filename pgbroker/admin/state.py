"""What the admin views share: the app's state (its pool, credentials and named queries) and
the ways a request gets at it, a redirect back on this site included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import psycopg
from flask import current_app, g, redirect, request
from psycopg_pool import ConnectionPool
from werkzeug.wrappers import Response as BaseResponse

from .._pg.catalogue import Queries
from ..errors import DatabaseUnavailable
from ..metrics import MetricsReader, Snapshot
from ..ops import Operations
from .auth import Credentials, LoginThrottle

__all__ = ["AdminState", "admin_state", "back", "local_target", "operations", "paused"]


@dataclass
class AdminState:
    """What the app's views share; ``app.extensions["pgbroker"]``."""

    pool: ConnectionPool
    schema: str
    credentials: Credentials
    reader: MetricsReader
    refresh: float
    registry: Any
    throttle: LoginThrottle
    q: Queries
    #: for a consumer row of an older pgbroker, which holds no lease of its own
    lease_timeout: float
    #: logins come from the server the app is mounted in (create_app's trust_environ)
    trust_environ: bool = False

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self.pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"admin page: {exc}") from exc

    def rows(self, name: str, **params: Any) -> list[dict[str, Any]]:
        """Every row of the named query ``name`` (``sql/*.sql``), as dicts."""
        with self.connection() as conn:
            return self.q.dicts(conn, name, params)

    def now(self, conn: psycopg.Connection[Any]) -> datetime:
        """The database's clock (the one every page shows times in)."""
        return self.q.one(conn, "admin_now")[0]  # type: ignore[no-any-return]

    def snapshot(self) -> Snapshot:
        with self.connection() as conn:
            return self.reader.snapshot(conn)

    def close(self) -> None:
        self.pool.close()


def admin_state() -> AdminState:
    """The state of the app serving this request."""
    return current_app.extensions["pgbroker"]  # type: ignore[no-any-return]


@contextmanager
def operations() -> Iterator[Operations]:
    """:class:`Operations` on a pooled connection, as the logged-in user, for this request."""
    with admin_state().connection() as conn:
        yield Operations(conn, admin_state().schema, actor=g.login.actor, via="admin")


def paused() -> list[dict[str, Any]]:
    """What is paused: queues, and task names (with why and the jobs that caused it)."""
    return [{"kind": "queue", **r} for r in admin_state().rows("queue_paused_list")] + [
        {"kind": "task", "name": r["task"], "actor": r["paused_by"], "at": r["paused_at"],
         "reason": r["reason"], "job_ids": r["job_ids"], "waiting": r["waiting"]}
        for r in admin_state().rows("task_pause_list")]


_URL_NOISE = re.compile(r"[\t\n\r]")
_C0_AND_SPACE = "".join(map(chr, range(0x21)))


def local_target(target: str | None, default: str) -> str:
    """A redirect target on this site only, judged as a browser reads it: browsers drop tabs
    and newlines anywhere in a URL, strip control characters and spaces around it and take a
    backslash for a slash, so ``/\\t/evil.example`` is ``//evil.example``, another site."""
    if not target:
        return default
    cleaned = _URL_NOISE.sub("", target).strip(_C0_AND_SPACE)
    if (not cleaned.startswith("/") or cleaned[1:2] in ("/", "\\") or "\\" in cleaned
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in cleaned)):
        return default
    parts = urlsplit(cleaned)
    if parts.scheme or parts.netloc:
        return default
    return cleaned


def back(default: str = "/") -> BaseResponse:
    # script_root: the app mounted under a prefix (pgbroker.contrib.django.operator)
    return redirect(request.script_root + local_target(request.form.get("next"), default),
                    code=303)
