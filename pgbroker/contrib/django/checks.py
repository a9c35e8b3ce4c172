"""System checks (``manage.py check``) for what a Django project gets wrong with pgbroker.

=====================  ========================================================================
``pgbroker.W001``      the schema is missing in ``DATABASES["default"]`` and pgbroker's
                       migration is not applied: run ``manage.py migrate``
``pgbroker.E001``      the schema is missing or not at this version although pgbroker's Django
                       migration is recorded (``migrate --fake``, a dropped schema): run
                       ``manage.py pgbroker migrate``
``pgbroker.E002``      ``PGBROKER_JOIN_ATOMIC`` is on but the broker (``CELERY_BROKER_URL``) is
                       another database than ``DATABASES["default"]``: nothing would join
``pgbroker.W002``      the same without the setting: jobs written on Django's connection
                       (``pgbroker.contrib.django.enqueue``) land where no worker reads
``pgbroker.E003``      a beat entry sends a ``concurrency_key`` or ``dedupe_active`` to a task
                       acked on receipt: its copies would not be held back while it runs
``pgbroker.E004``      the broker URL names no transport kombu knows, or a PostgreSQL URL
                       without ``pgbroker+``, or the ``pgbroker`` scheme is not pgbroker's
=====================  ========================================================================

The schema checks read the database (two short queries on Django's connection); an unreachable
database skips them, as it skips nothing else in Django's checks. The rest read settings only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.migrations.recorder import MigrationRecorder
from kombu.transport import resolve_transport

from ..._pg.django_db import driver_connection
from ...errors import ConfigurationError, PgBrokerError, SchemaError
from ...migrate import check as check_schema
from ...transport import Transport
from . import conf

__all__ = ["LABEL", "check_atomic_database", "check_early_acks", "check_schema_present",
           "check_transport", "register_all"]

#: pgbroker's Django app label (its migrations are recorded under it).
LABEL = "pgbroker"

_POSTGRES = ("postgres", "postgresql")


def _recorded(db: Any) -> bool:
    recorder = MigrationRecorder(db)
    return bool(recorder.has_table() and recorder.migration_qs.filter(app=LABEL).exists())


def check_schema_present(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W001 / E001."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql":
        return []
    schema = conf.settings().schema
    try:
        try:
            check_schema(driver_connection(db), schema)
            return []
        except SchemaError as exc:
            problem = str(exc)
        recorded = _recorded(db)
    except (DatabaseError, PgBrokerError, TypeError, OSError) as exc:  # unreachable, psycopg2
        del exc  # the database cannot be read: nothing to say about its schema
        return []
    name = db.settings_dict.get("NAME")
    if recorded:
        return [Error(
            f"pgbroker's schema {schema!r} in database {name!r} is not usable although its "
            f"Django migration is recorded as applied ({problem})",
            hint="run `manage.py pgbroker migrate` (the migration was faked, or the schema was "
                 "dropped after it ran)", id="pgbroker.E001")]
    return [Warning(f"pgbroker's schema {schema!r} is missing in database {name!r}",
                    hint="run `manage.py migrate`", id="pgbroker.W001")]


def check_atomic_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E002 / W002."""
    db = connections[DEFAULT_DB_ALIAS]
    try:
        found = conf.broker()
    except ConfigurationError:
        return []  # check_transport says why
    if found is None or db.vendor != "postgresql" or conf.same_database(found.conninfo, db):
        return []
    where = "CELERY_BROKER_URL names another database than DATABASES['default']"
    if conf.join_atomic():
        return [Error(
            f"{conf.JOIN_ATOMIC} is on, but {where}: no .delay() inside atomic() can be written "
            "in Django's transaction", hint="point CELERY_BROKER_URL at the database of "
            "DATABASES['default'] (same host, port and name), or turn the setting off",
            id="pgbroker.E002")]
    return [Warning(
        f"{where}: jobs written on Django's connection (pgbroker.contrib.django.enqueue, "
        "transaction()) would land in a database no worker reads",
        hint="point CELERY_BROKER_URL at DATABASES['default'] to enqueue in Django's "
             "transactions, or silence pgbroker.W002 if you never do", id="pgbroker.W002")]


def _beat_entries(app: Any) -> Iterable[tuple[str, dict[str, Any]]]:
    for name, entry in (app.conf.beat_schedule or {}).items():
        if isinstance(entry, dict):
            yield name, entry


def check_early_acks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E003."""
    app = conf.celery_app()
    found = []
    for name, entry in _beat_entries(app):
        headers = (entry.get("options") or {}).get("headers") or {}
        keys = [k for k in ("concurrency_key", "dedupe_active") if headers.get(k)]
        if not keys:
            continue
        task = app.tasks.get(entry.get("task")) if app.finalized else None
        acks_late = task.acks_late if task is not None else app.conf.task_acks_late
        if not acks_late:
            found.append(Error(
                f"beat entry {name!r} sends {' and '.join(keys)} to task {entry.get('task')!r}, "
                "which is acked on receipt: a job counts as running only until its ack, so its "
                "copies would not be held back while it runs",
                hint="set CELERY_TASK_ACKS_LATE = True (or acks_late=True on the task)",
                id="pgbroker.E003"))
    return found


def check_transport(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E004."""
    app = conf.celery_app()
    url = str(app.conf.broker_write_url or app.conf.broker_url or "")
    scheme = url.partition("://")[0] if "://" in url else ""
    if not scheme:
        return []
    fix = "write CELERY_BROKER_URL = 'pgbroker+postgresql://user@host:5432/dbname'"
    try:
        resolved = resolve_transport(scheme.partition("+")[0])
    except ImportError:
        return []  # another broker whose client library is missing: not pgbroker's business
    except KeyError as exc:
        if scheme.lower() in _POSTGRES:
            return [Error(f"CELERY_BROKER_URL is a plain PostgreSQL URL ({scheme}://): kombu "
                          "has no transport of that name", hint=fix, id="pgbroker.E004")]
        return [Error(f"the broker URL's scheme {scheme!r} is no transport kombu knows ({exc})",
                      hint=fix + " (pgbroker's Django app registers the scheme)",
                      id="pgbroker.E004")]
    if scheme.partition("+")[0] == "pgbroker" and not (
            isinstance(resolved, type) and issubclass(resolved, Transport)):
        return [Error(f"the 'pgbroker' scheme is registered to {resolved!r}, not pgbroker's "
                      "transport", hint="remove the other registration of kombu's "
                      "TRANSPORT_ALIASES['pgbroker']", id="pgbroker.E004")]
    if scheme.lower().endswith(("+postgresql", "+postgres")) and not scheme.startswith(
            "pgbroker"):
        return [Error(f"the broker URL ({scheme}://) is another transport on PostgreSQL, not "
                      "pgbroker's", hint=fix, id="pgbroker.E004")]
    return []


def register_all() -> None:
    """Register every check with Django (tag ``pgbroker``)."""
    for check in (check_schema_present, check_atomic_database, check_early_acks,
                  check_transport):
        register(check, LABEL)
