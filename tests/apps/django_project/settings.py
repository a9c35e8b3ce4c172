"""Django settings of the test project: PostgreSQL through psycopg 3, pgbroker as Celery's broker
and result backend, both on the database named by the environment."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

from pgbroker._pg.local_server import normalize_url

_URL = os.environ.get("PGBROKER_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
_DB = conninfo_to_dict(normalize_url(_URL))

SECRET_KEY = "pgbroker-tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django.contrib.sessions",
                  "pgbroker.contrib.django", "tests.apps.django_project.shop"]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.apps.django_project.urls"  # pgbroker's operator page, behind Django's login
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3 when installed (Django >= 4.2)
        "NAME": _DB.get("dbname", "postgres"),
        "USER": _DB.get("user", "postgres"),
        "PASSWORD": _DB.get("password", ""),
        "HOST": _DB.get("host", "127.0.0.1"),
        "PORT": str(_DB.get("port", "5432")),
    },
    # Not PostgreSQL: pgbroker.contrib.django must refuse it clearly.
    "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}

# Celery, the way Django projects configure it (app.config_from_object(..., namespace="CELERY")).
CELERY_BROKER_URL = "pgbroker+" + normalize_url(_URL)
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Django's task framework (the django-tasks backport on Django 5) on pgbroker
TASKS = {"default": {"BACKEND": "pgbroker.contrib.django.tasks.Backend",
                     "QUEUES": ["default", "urgent"]}}
# ends the broker's sessions on the test database before Django drops it (manage.py test)
TEST_RUNNER = "pgbroker.contrib.django.testing.DiscoverRunner"

if os.environ.get("PGBROKER_TEST_NO_BROKER"):  # a project whose Celery broker is not set
    del CELERY_BROKER_URL, CELERY_RESULT_BACKEND
