"""pgbroker's operator page inside a Django project, behind Django's own login.

::

    # urls.py
    path("ops/pgbroker/", include("pgbroker.contrib.django.urls")),

The page is pgbroker's admin app (:mod:`pgbroker.admin`, the ``admin`` extra: Flask), mounted as
a WSGI app under that URL and told who the Django user is: **staff** users see every page
(read-only), staff users with the permission ``pgbroker.operate`` (give it to a user or a group
in Django's admin) may also act -- retry, discard, cancel, pause -- and every action is audited
with their Django username. Others are sent to ``settings.LOGIN_URL`` (not logged in) or get
403 (not staff). One login: no ``PGBROKER_ADMIN_*`` credentials. Every POST still carries the
page's own CSRF token (kept in the Django session), so the view is exempt from Django's.

The app is made once per process, on the project's broker database (else
``DATABASES["default"]``) and schema, with a pool of its own. Limits: the response is read whole
before it is returned (the pages are small; no streaming); ``/metrics`` below the mount needs a
staff login too -- a Prometheus scraper keeps using ``manage.py pgbroker serve``'s.
"""

from __future__ import annotations

import io
import threading
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from ..._pg.django_db import alias_conninfo
from ...admin.auth import OPERATOR, VIEWER, Login, new_csrf_token
from ...admin.guards import TRUSTED_LOGIN
from . import conf

__all__ = ["PERMISSION", "operator_page", "page_app"]

#: The permission that lets a staff user act on the page.
PERMISSION = "pgbroker.operate"

_CSRF_KEY = "pgbroker_operator_csrf"
_app: Any = None
_app_lock = threading.Lock()


def page_app() -> Any:
    """The admin app of this process (made at first use)."""
    global _app
    with _app_lock:
        if _app is None:
            # optional: the admin extra (Flask), only for a project that mounts the page
            from ...admin.app import create_app

            found = conf.broker()
            conninfo = found.conninfo if found is not None else alias_conninfo("default")
            _app = create_app(conninfo, conf.settings().schema, trust_environ=True)
        return _app


def _role(request: HttpRequest) -> str:
    user = request.user
    if not user.is_authenticated:
        raise _Login
    if not user.is_staff:
        raise PermissionDenied("pgbroker's operator page is for staff users")
    return OPERATOR if user.has_perm(PERMISSION) else VIEWER


class _Login(Exception):
    """Not logged in: to Django's login page."""


@csrf_exempt  # every POST carries the page's own CSRF token, checked by the page
def operator_page(request: HttpRequest, path: str = "") -> HttpResponse:
    """The operator page at ``path`` below the mount (see the module docstring)."""
    try:
        role = _role(request)
    except _Login:
        return redirect_to_login(request.get_full_path())
    token = request.session.get(_CSRF_KEY)
    if not token:
        token = request.session[_CSRF_KEY] = new_csrf_token()
    body = request.body
    environ = dict(request.META)
    environ.update({
        "SCRIPT_NAME": request.path[:len(request.path) - len(path)].rstrip("/"),
        "PATH_INFO": "/" + path, "wsgi.input": io.BytesIO(body),
        "CONTENT_LENGTH": str(len(body)),
        TRUSTED_LOGIN: (Login(actor=request.user.get_username(), role=role), token)})
    started: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started.update(status=status, headers=headers)
        return lambda data: None

    result = page_app()(environ, start_response)
    try:
        content = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    response = HttpResponse(content, status=int(started["status"].split()[0]))
    for name, value in started["headers"]:
        if name.lower() == "set-cookie":  # the page's own (its flashed messages)
            response.cookies.load(value)
        elif name.lower() != "content-length":
            response[name] = value
    return response
