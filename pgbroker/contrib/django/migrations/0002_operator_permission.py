"""The ``pgbroker.operate`` permission (an unmanaged model, no table: see ``models.py``)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies: list[Any] = [("pgbroker", "0001_schema")]

    operations = [
        migrations.CreateModel(
            name="Operator",
            fields=[("id", models.BigAutoField(auto_created=True, primary_key=True,
                                               serialize=False, verbose_name="ID"))],
            options={"managed": False, "default_permissions": (),
                     "permissions": [("operate", "Can act on pgbroker's operator page")]},
        ),
    ]
