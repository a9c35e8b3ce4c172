"""The project's Celery app, exactly as Celery's "First steps with Django" writes it.

No ``import pgbroker``: pgbroker's Django app (INSTALLED_APPS) registers the ``pgbroker://``
scheme in Django processes, and pgbroker's Celery CLI plugin in ``celery worker`` and ``beat``.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ticketsite.settings")

app = Celery("ticketsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
