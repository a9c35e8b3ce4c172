"""pgbroker's Django app: ``"pgbroker.contrib.django"`` in ``INSTALLED_APPS``.

What it brings: the schema by ``manage.py migrate`` (:mod:`.migrations`), ``manage.py pgbroker``
(:mod:`.management.commands.pgbroker`), the system checks (:mod:`.checks`), the ``pgbroker://``
scheme registered with kombu in every process that loads the project (``runserver``, gunicorn,
``manage.py shell``, the Celery worker), and, with ``PGBROKER_JOIN_ATOMIC = True``, ``.delay()``
joining ``atomic()`` (:mod:`.atomic`). See docs/django.md.
"""

from __future__ import annotations

from django.apps import AppConfig

from ...transport import register_scheme
from . import atomic, checks, conf

__all__ = ["PgBrokerConfig"]


class PgBrokerConfig(AppConfig):
    name = "pgbroker.contrib.django"
    label = checks.LABEL
    verbose_name = "pgbroker"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        register_scheme()  # done by `import pgbroker` already (a parent package): said here
        checks.register_all()
        if conf.join_atomic():
            atomic.install()
        else:
            atomic.uninstall()
