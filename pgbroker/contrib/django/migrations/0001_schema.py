"""pgbroker's schema, made by ``manage.py migrate`` (and so in Django's test databases).

The operation runs pgbroker's own numbered migrations (:func:`pgbroker.migrate.apply_on`) on
Django's connection, in the transaction of this migration, under pgbroker's advisory lock: a
schema migrated already by ``pgbroker migrate`` or a worker (``auto_migrate``) is left as it is.
The schema is the broker's ``schema`` transport option (``CELERY_BROKER_TRANSPORT_OPTIONS``).
It runs on every PostgreSQL database Django migrates (routers permitting), and does nothing on
another vendor.

Unapplying it (``migrate pgbroker zero``) does nothing, on purpose: the schema holds the queue,
and dropping jobs is not a migration's call; drop the schema by hand if you mean it
(``DROP SCHEMA pgbroker CASCADE``). ``migrate --fake`` records it without a schema: the system
check ``pgbroker.E001`` then says to run ``manage.py pgbroker migrate``. Later pgbroker versions
add their schema changes by a new Django migration here, each running the same function.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

from ...._pg.django_db import driver_connection
from ....migrate import MIGRATIONS, apply_on
from .. import conf


def apply_schema(apps: Any, schema_editor: Any) -> None:
    """Apply pgbroker's pending migrations on the database being migrated."""
    db = schema_editor.connection
    if db.vendor != "postgresql":
        return
    apply_on(driver_connection(db), conf.settings().schema, MIGRATIONS)


class Migration(migrations.Migration):
    dependencies: list[Any] = []

    operations = [
        migrations.RunPython(apply_schema, migrations.RunPython.noop, elidable=False),
    ]
