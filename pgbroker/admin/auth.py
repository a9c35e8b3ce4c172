"""Who may use the admin page: credentials and roles, logins, sessions, CSRF tokens.

* Credentials come from the environment. An **operator** may act (retry, cancel, pause...):
  ``PGBROKER_ADMIN_USER`` + ``PGBROKER_ADMIN_PASSWORD`` (a person logs in with them) and/or
  ``PGBROKER_ADMIN_TOKEN`` (typed in the login form, or sent by a scraper as
  ``Authorization: Bearer``). A **viewer** sees every page and acts on nothing:
  ``PGBROKER_ADMIN_VIEWER_USER`` + ``PGBROKER_ADMIN_VIEWER_PASSWORD`` and/or
  ``PGBROKER_ADMIN_VIEWER_TOKEN`` (the token for a Prometheus scraper). All are compared in
  constant time. A token shorter than 16 characters or a password shorter than 12 (or either
  made of fewer than 6 different characters) is refused at start-up.
* A login is a row of ``<schema>.admin_sessions`` (migration 0006) holding the SHA-256 of a random
  session id, the actor, the role and the session's CSRF token; the cookie (signed, HttpOnly,
  SameSite=Lax, and ``Secure`` with ``PGBROKER_ADMIN_SECURE_COOKIE=1``) carries the id. Logout
  deletes the row, so a cookie saved before is refused afterwards, for pages and POSTs alike. A
  session ends after 8 hours without a request, and 24 hours after its login in any case.
* Every form carries the session's CSRF token and every POST without it, or with another one, is
  refused with 400 -- login included (its token lives in the cookie until the login).
* ``/metrics`` also accepts HTTP Basic (user/password) or Bearer (token) credentials, since a
  scraper has no session. Form actions never do: a browser replays cached Basic credentials on
  its own, which would reopen the door CSRF tokens close.
* Failed logins are throttled per client address (10 at once, then one every 6 s) and in total
  (100 at once, then ten a second): the 11th wrong password in a row from one address waits.
  One throttle guards every place that checks credentials (:meth:`LoginThrottle.check`): the
  login form and a scraper's Basic or Bearer credentials on ``/metrics`` share its budget, and
  while an address waits, even the right credentials are refused (429), or guessing would go on.

Limits, honestly: the throttle is per server process and trusts the connection's address, so
behind a reverse proxy every client is the proxy (one budget for all; throttle at the proxy
then). The cookie's signing key is random per process unless ``PGBROKER_ADMIN_SECRET`` is set:
a restart logs everyone out, and several server processes behind one address need the same
secret.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from .._pg.catalogue import Queries
from ..errors import ConfigurationError

__all__ = ["Credentials", "Login", "LoginThrottle", "OPERATOR", "VIEWER", "Throttled",
           "is_loopback", "new_csrf_token", "same_secret"]

ENV_USER = "PGBROKER_ADMIN_USER"
ENV_PASSWORD = "PGBROKER_ADMIN_PASSWORD"
ENV_TOKEN = "PGBROKER_ADMIN_TOKEN"
ENV_VIEWER_USER = "PGBROKER_ADMIN_VIEWER_USER"
ENV_VIEWER_PASSWORD = "PGBROKER_ADMIN_VIEWER_PASSWORD"
ENV_VIEWER_TOKEN = "PGBROKER_ADMIN_VIEWER_TOKEN"
ENV_SECRET = "PGBROKER_ADMIN_SECRET"
ENV_SECURE_COOKIE = "PGBROKER_ADMIN_SECURE_COOKIE"

OPERATOR = "operator"
VIEWER = "viewer"

MIN_TOKEN_LENGTH = 16
MIN_PASSWORD_LENGTH = 12
MIN_DISTINCT_CHARACTERS = 6

#: Seconds a session lives without a request, and at most after its login.
SESSION_IDLE = 8 * 3600.0
SESSION_LIFETIME = 24 * 3600.0


def same_secret(given: str | None, expected: str | None) -> bool:
    """Constant-time equality; False when either side is missing or empty."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def _check_strength(variable: str, value: str | None, minimum: int) -> None:
    if value is None:
        return
    if len(value) < minimum or len(set(value)) < MIN_DISTINCT_CHARACTERS:
        raise ConfigurationError(
            f"{variable} is too weak: use at least {minimum} characters, of at least "
            f"{MIN_DISTINCT_CHARACTERS} different ones (make one with: python -c 'import "
            f"secrets; print(secrets.token_urlsafe(32))')")


@dataclass(frozen=True)
class Login:
    """Who is logged in, and what they may do."""

    actor: str
    role: str

    @property
    def can_act(self) -> bool:
        return self.role == OPERATOR


@dataclass(frozen=True)
class Credentials:
    """The configured ways in: per role, a user and password, a token, or both."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    viewer_user: str | None = None
    viewer_password: str | None = None
    viewer_token: str | None = None

    def __post_init__(self) -> None:
        for user, password, names in (
                (self.user, self.password, (ENV_USER, ENV_PASSWORD, ENV_TOKEN)),
                (self.viewer_user, self.viewer_password,
                 (ENV_VIEWER_USER, ENV_VIEWER_PASSWORD, ENV_VIEWER_TOKEN))):
            if bool(user) != bool(password):
                raise ConfigurationError(f"set both {names[0]} and {names[1]} (or neither and "
                                         f"use {names[2]})")
        if self.user and self.viewer_user and self.user == self.viewer_user:
            raise ConfigurationError(f"{ENV_USER} and {ENV_VIEWER_USER} must differ")
        _check_strength(ENV_PASSWORD, self.password, MIN_PASSWORD_LENGTH)
        _check_strength(ENV_VIEWER_PASSWORD, self.viewer_password, MIN_PASSWORD_LENGTH)
        _check_strength(ENV_TOKEN, self.token, MIN_TOKEN_LENGTH)
        _check_strength(ENV_VIEWER_TOKEN, self.viewer_token, MIN_TOKEN_LENGTH)
        if self.token and same_secret(self.token, self.viewer_token):
            raise ConfigurationError(f"{ENV_TOKEN} and {ENV_VIEWER_TOKEN} must differ")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        env = os.environ if env is None else env
        return cls(*(env.get(name) or None for name in (
            ENV_USER, ENV_PASSWORD, ENV_TOKEN, ENV_VIEWER_USER, ENV_VIEWER_PASSWORD,
            ENV_VIEWER_TOKEN)))

    @property
    def configured(self) -> bool:
        """True when an operator can log in (a viewer alone could never act)."""
        return bool(self.password or self.token)

    @property
    def passwords(self) -> bool:
        return bool(self.password or self.viewer_password)

    @property
    def tokens(self) -> bool:
        return bool(self.token or self.viewer_token)

    def login(self, user: str | None, password: str | None, token: str | None) -> Login | None:
        """Who logs in with these, else None. Every comparison is made, whatever matches."""
        found = None
        for role, u, p, t in ((VIEWER, self.viewer_user, self.viewer_password,
                               self.viewer_token),
                              (OPERATOR, self.user, self.password, self.token)):
            if p and same_secret(user, u) and same_secret(password, p):
                found = Login(str(u), role)
            if t and same_secret(token, t):
                found = Login(u or ("token" if role == OPERATOR else "viewer-token"), role)
        return found


class Throttled(Exception):
    """Too many failed credential checks from one address: it may try again in ``wait`` s."""

    def __init__(self, address: str, wait: float):
        super().__init__(f"{address}: too many failed logins, try again in {wait:.0f} s")
        self.wait = wait

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header's value."""
        return str(max(1, round(self.wait)))


class LoginThrottle:
    """Failed logins per client address and in total, as token buckets: each address may fail
    ``burst`` times at once and then once per ``interval`` seconds; all addresses together
    ``total_burst`` times and then once per ``total_interval``. Thread-safe; in memory."""

    def __init__(self, burst: int = 10, interval: float = 6.0, total_burst: int = 100,
                 total_interval: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 max_addresses: int = 10000):
        self._limits = {False: (burst, interval), True: (total_burst, total_interval)}
        self._clock = clock
        self._max = max_addresses
        self._buckets: dict[tuple[bool, str], tuple[float, float]] = {}  # -> (tokens, at)
        self._lock = threading.Lock()

    def _tokens(self, key: tuple[bool, str], now: float) -> float:
        burst, interval = self._limits[key[0]]
        tokens, at = self._buckets.get(key, (float(burst), now))
        return min(float(burst), tokens + (now - at) / interval)

    def wait(self, address: str) -> float:
        """Seconds before ``address`` may try again (0: now)."""
        now = self._clock()
        with self._lock:
            return max(max(0.0, 1.0 - self._tokens(key, now)) * self._limits[key[0]][1]
                       for key in ((False, address), (True, "")))

    def check(self, address: str, creds: Credentials, user: str | None, password: str | None,
              token: str | None) -> Login | None:
        """Who ``creds`` let in with these credentials from ``address`` (None: nobody, and a
        failure counted); :class:`Throttled` while the address must wait, whatever it sends.
        Every credential check goes through here: one budget per address for all of them."""
        wait = self.wait(address)
        if wait > 0:
            raise Throttled(address, wait)
        found = creds.login(user, password, token)
        if found is None:
            self.failed(address)
        return found

    def failed(self, address: str) -> None:
        now = self._clock()
        with self._lock:
            if len(self._buckets) >= self._max:  # forget the addresses that are whole again
                self._buckets = {k: v for k, v in self._buckets.items()
                                 if self._tokens(k, now) < self._limits[k[0]][0]}
            for key in ((False, address), (True, "")):
                self._buckets[key] = (self._tokens(key, now) - 1.0, now)


# -- sessions (rows of <schema>.admin_sessions; statements in sql/admin.sql) ---------------------

@dataclass(frozen=True)
class Session:
    login: Login
    csrf: str


def _key(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8")).digest()


def open_session(conn: psycopg.Connection[Any], q: Queries, login: Login,
                 address: str | None) -> str:
    """A new session for ``login``; returns its id (for the cookie only)."""
    session_id = secrets.token_urlsafe(32)
    q.execute(conn, "admin_session_insert", {
        "id": _key(session_id), "actor": login.actor, "role": login.role,
        "csrf": new_csrf_token(), "address": address, "idle": SESSION_IDLE,
        "lifetime": SESSION_LIFETIME})
    return session_id


def find_session(conn: psycopg.Connection[Any], q: Queries,
                 session_id: str) -> Session | None:
    """The live session of this id (renewed), or None: unknown, logged out or expired."""
    row = q.one(conn, "admin_session_get", {
        "id": _key(session_id), "idle": SESSION_IDLE, "lifetime": SESSION_LIFETIME})
    return None if row is None else Session(Login(row[0], row[1]), row[2])


def close_session(conn: psycopg.Connection[Any], q: Queries, session_id: str) -> None:
    q.execute(conn, "admin_session_delete", {"id": _key(session_id)})


def is_loopback(host: str) -> bool:
    """True for a listening address reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, or '' (every address): not provably local
