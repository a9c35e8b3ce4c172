"""What pgbroker's Django app reads from a project's settings: the Celery app, its pgbroker
broker, and whether a Django database connection is that broker's database.

The Celery app is ``PGBROKER_CELERY_APP`` (``"proj.celery:app"``) when set, else one configured
the way Celery's guide for Django configures it::

    app.config_from_object("django.conf:settings", namespace="CELERY")

so ``CELERY_BROKER_URL`` and ``CELERY_BROKER_TRANSPORT_OPTIONS`` give the database and the
schema. No I/O here: kombu only parses the URL.

Two connections are "the same database" when their database name and port are equal and their
hosts are equal or both local (``localhost``, ``127.0.0.1``, ``::1``, a Unix socket, none). Limit:
two names of one server (a DNS alias and its address) are told apart, so pgbroker then refuses
to join (a warning and a system check say so) rather than guess.
"""

from __future__ import annotations

from typing import Any

from psycopg.conninfo import conninfo_to_dict

from ..._celery.app import Broker, find
from ..._pg.django_db import conninfo_of
from ...errors import ConfigurationError
from ...settings import Settings

__all__ = ["JOIN_ATOMIC", "TASK_NAME", "broker", "celery_app", "join_atomic", "same_database",
           "settings"]

#: The Celery task name of every ``django.tasks`` task's message (pgbroker.contrib.django.tasks).
TASK_NAME = "pgbroker.django_task"

#: The Django setting that makes ``.delay()`` join Django's ``atomic()`` (off by default).
JOIN_ATOMIC = "PGBROKER_JOIN_ATOMIC"

_LOCAL = frozenset({"", "localhost", "127.0.0.1", "::1"})


def celery_app() -> Any:
    """The project's Celery app (see the module docstring)."""
    # Django and Celery's loader: this module serves Django projects only
    from celery import Celery
    from celery.utils.imports import symbol_by_name
    from django.conf import settings as django_settings

    name = getattr(django_settings, "PGBROKER_CELERY_APP", None)
    if name:
        return symbol_by_name(name)
    app = Celery("django", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return app


def broker() -> Broker | None:
    """The project's pgbroker broker, or None if its Celery broker is another (or unset).

    Raises:
        ConfigurationError: kombu cannot tell the broker (a malformed URL, an unknown scheme).
    """
    app = celery_app()
    if not app.conf.broker_url and not app.conf.broker_write_url:
        return None
    return find(app)


def settings() -> Settings:
    """The settings of the project's pgbroker broker (defaults if it has none)."""
    try:
        found = broker()
    except ConfigurationError:
        found = None
    return found.settings if found is not None else Settings()


def join_atomic() -> bool:
    """Whether the project opted in to ``.delay()`` joining ``atomic()``."""
    # Django's settings: this module serves Django projects only
    from django.conf import settings as django_settings

    return bool(getattr(django_settings, JOIN_ATOMIC, False))


def _where(conninfo: str) -> tuple[str, str, str]:
    params = conninfo_to_dict(conninfo)
    host = str(params.get("host") or "")
    if host in _LOCAL or host.startswith("/"):
        host = "local"
    return host, str(params.get("port") or "5432"), str(params.get("dbname") or "")


def same_database(conninfo: str, db: Any) -> bool:
    """Whether Django database connection ``db`` reaches the database of ``conninfo``."""
    return _where(conninfo) == _where(conninfo_of(db))
