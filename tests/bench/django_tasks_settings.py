"""Settings of the django.tasks benchmark (:mod:`tests.bench.django_tasks_bench`): the test
project on its database, with two task backends -- pgbroker's (``default``) and django-tasks-db's
(``db``) -- on the same database, for the same task."""

from __future__ import annotations

from tests.apps.django_project.settings_atomic import *  # noqa: F403 - the test project's settings
from tests.apps.django_project.settings_atomic import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
TASKS = {"default": {"BACKEND": "pgbroker.contrib.django.tasks.Backend",
                     "QUEUES": ["default", "urgent"]},
         "db": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default", "urgent"]}}
