"""Who may use the admin page: credentials, the login session, CSRF tokens.

* Credentials come from the environment: ``PGBROKER_ADMIN_USER`` + ``PGBROKER_ADMIN_PASSWORD``
  (a person logs in with them) and/or ``PGBROKER_ADMIN_TOKEN`` (typed in the login form, or sent
  by a Prometheus scraper as ``Authorization: Bearer``). They are compared in constant time.
* A login starts a new session (a signed, HttpOnly, SameSite=Lax cookie) holding the user name
  and a random CSRF token; every form carries that token and every POST without it, or with
  another one, is refused with 400 -- login included.
* ``/metrics`` also accepts HTTP Basic (user/password) or Bearer (token) credentials, since a
  scraper has no session. Form actions never do: a browser replays cached Basic credentials on
  its own, which would reopen the door CSRF tokens close.

Limits, honestly: there is no rate limit on login attempts (use long passwords or a token, and a
reverse proxy for anything exposed); the session key is random per process unless
``PGBROKER_ADMIN_SECRET`` is set, so a restart logs everyone out, and several server processes
behind one address need the same secret.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["Credentials", "is_loopback", "new_csrf_token", "same_secret"]

ENV_USER = "PGBROKER_ADMIN_USER"
ENV_PASSWORD = "PGBROKER_ADMIN_PASSWORD"
ENV_TOKEN = "PGBROKER_ADMIN_TOKEN"
ENV_SECRET = "PGBROKER_ADMIN_SECRET"


def same_secret(given: str | None, expected: str | None) -> bool:
    """Constant-time equality; False when either side is missing or empty."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Credentials:
    """The configured ways in: a user and password, a token, or both."""

    user: str | None = None
    password: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password):
            raise ConfigurationError(
                f"set both {ENV_USER} and {ENV_PASSWORD} (or neither and use {ENV_TOKEN})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        env = os.environ if env is None else env
        return cls(env.get(ENV_USER) or None, env.get(ENV_PASSWORD) or None,
                   env.get(ENV_TOKEN) or None)

    @property
    def configured(self) -> bool:
        return bool(self.password or self.token)

    def login(self, user: str | None, password: str | None, token: str | None) -> str | None:
        """The actor name for a successful login, else None."""
        if self.password and same_secret(user, self.user) and same_secret(password, self.password):
            return self.user
        if self.token and same_secret(token, self.token):
            return self.user or "token"
        return None


def is_loopback(host: str) -> bool:
    """True for a listening address reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, or '' (every address): not provably local
