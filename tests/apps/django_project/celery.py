"""The project's Celery app, as in Celery's "First steps with Django"."""

from __future__ import annotations

import os

from celery import Celery

import pgbroker  # noqa: F401 - registers pgbroker://

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_project.settings")

app = Celery("django_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
