"""A Celery app configured from the Django project's settings, for pgbroker's command line.

``manage.py pgbroker ...`` runs ``pgbroker -A pgbroker.contrib.django.celery_app ...`` when the
project names no app of its own (``PGBROKER_CELERY_APP``): this app reads ``CELERY_BROKER_URL``
and ``CELERY_BROKER_TRANSPORT_OPTIONS`` as Celery's guide for Django configures an app. It is
not the current app and runs no task; its configuration is read once, at first use.
"""

from __future__ import annotations

from celery import Celery

__all__ = ["app"]

app = Celery("django", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
