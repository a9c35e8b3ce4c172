"""Who may use the admin app and how: the login check before every request (a session, or
a scraper's credentials for /metrics), CSRF on every POST, read-only logins refused any action,
the security headers of every response, and the page shown when the database is unreachable.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from flask import Flask, Response, abort, g, redirect, render_template, request, session, url_for

from ..errors import DatabaseUnavailable
from .auth import Login, Throttled, find_session, new_csrf_token, same_secret
from .state import AdminState, admin_state

__all__ = ["TRUSTED_LOGIN", "install"]

#: The WSGI environ key of a login made by the server the app is mounted in: a (Login, CSRF
#: token) pair, trusted only by an app made with ``create_app(..., trust_environ=True)``.
TRUSTED_LOGIN = "pgbroker.admin.login"

logger = logging.getLogger("pgbroker.admin.app")  # the name its lines have always had

#: Endpoints open without a login.
_PUBLIC = frozenset({"login", "static", "favicon"})


def _scraper_refused(state: AdminState) -> Response | None:
    """None when a scraper's Basic or Bearer credentials let it read /metrics, else the answer:
    401, or 429 while its address is throttled -- the login form's throttle, or /metrics would
    be a password oracle beside it."""
    auth = request.authorization
    if auth is None:
        return _unauthenticated()  # nothing was guessed
    address = request.remote_addr or "?"
    try:
        found = state.throttle.check(address, state.credentials,
                                     *((None, None, auth.token) if auth.type == "bearer"
                                       else (auth.username, auth.password, None)))
    except Throttled as exc:
        logger.warning("pgbroker admin: /metrics credentials from %s refused for %.0f s (too "
                       "many failures)", address, exc.wait)
        return Response("too many failed logins: try again later\n", 429,
                        mimetype="text/plain", headers={"Retry-After": exc.retry_after})
    if found is None:
        logger.warning("pgbroker admin: wrong /metrics credentials from %s", address)
        return _unauthenticated()
    return None


def _unauthenticated() -> Response:
    return Response("authentication required\n", 401, mimetype="text/plain",
                    headers={"WWW-Authenticate": 'Basic realm="pgbroker"'})


def install(app: Flask) -> None:
    """Register the guards on ``app``."""
    @app.before_request
    def guard() -> Any:
        state = admin_state()
        endpoint = request.endpoint
        g.login, g.csrf = None, None
        sid = session.get("sid")
        trusted = request.environ.get(TRUSTED_LOGIN) if state.trust_environ else None
        if trusted is not None:  # the embedding server logged them in (contrib.django.operator)
            g.login, g.csrf = trusted
        elif endpoint not in _PUBLIC and sid:
            with state.connection() as conn:
                found = find_session(conn, state.q, sid)
            if found is not None:
                g.login, g.csrf = found.login, found.csrf
            else:
                session.pop("sid", None)  # logged out, or expired
        if endpoint not in _PUBLIC and g.login is None:
            if endpoint == "metrics":
                return _scraper_refused(state)
            if request.method == "GET" and "HX-Request" not in request.headers:
                return redirect(url_for("login", next=request.full_path.rstrip("?")))
            return _unauthenticated()
        if request.method == "POST":
            expected = g.csrf if g.login is not None else session.get("csrf")
            if not same_secret(request.form.get("csrf_token"), expected):
                logger.warning("pgbroker admin: refused a POST to %s without a valid CSRF token",
                               request.path)
                abort(400, description="CSRF token missing or invalid: reload the page and "
                                       "try again")
            if g.login is not None and not g.login.can_act and endpoint != "logout":
                logger.warning("pgbroker admin: refused a POST to %s by %s (read-only)",
                               request.path, g.login.actor)
                abort(403, description="read-only: this login can look, not act")
        return None

    @app.after_request
    def headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy",
                                    "default-src 'self'; frame-ancestors 'none'; "
                                    "form-action 'self'; base-uri 'none'")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.context_processor
    def csrf() -> dict[str, Any]:
        def token() -> str:
            if g.get("csrf"):
                return str(g.csrf)
            if "csrf" not in session:
                session["csrf"] = new_csrf_token()
            return str(session["csrf"])

        login: Login | None = g.get("login")
        return {"csrf_token": token, "login": login, "user": login.actor if login else None,
                "can_act": bool(login and login.can_act)}

    @app.errorhandler(DatabaseUnavailable)
    @app.errorhandler(psycopg.OperationalError)  # a statement that failed: a timeout, a full disk
    def unavailable(exc: Exception) -> tuple[str, int]:
        logger.warning("pgbroker admin: %s", exc)
        if "HX-Request" in request.headers:  # a live part: a line in its place
            return render_template("_unavailable.html", message=str(exc)), 503
        return render_template("error.html", message=str(exc)), 503
