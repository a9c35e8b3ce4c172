"""Settings of the example: one PostgreSQL database for the app AND the queue.

``DATABASE_URL`` (default ``postgresql://postgres@127.0.0.1:5432/ticketsite``) is Django's
database; ``CELERY_BROKER_URL = "pgbroker+django://default"`` makes it the broker's as well, so
``manage.py test`` moves both to the test database together.
"""

import os

from psycopg.conninfo import conninfo_to_dict

_DB = conninfo_to_dict(os.environ.get("DATABASE_URL",
                                      "postgresql://postgres@127.0.0.1:5432/ticketsite"))

SECRET_KEY = os.environ.get("SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DEBUG", "") == "1"
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "ticketsite.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "pgbroker.contrib.django",  # the schema by migrate, manage.py pgbroker, checks, atomic()
    "reservations",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3
        "NAME": _DB.get("dbname", "ticketsite"),
        "USER": _DB.get("user", "postgres"),
        "PASSWORD": _DB.get("password", ""),
        "HOST": _DB.get("host", "127.0.0.1"),
        "PORT": _DB.get("port", "5432"),
    },
}

EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = "tickets@ticketflow.example"

# -- Celery on pgbroker (seed 004's settings, the broker changed) ------------------------------
CELERY_BROKER_URL = "pgbroker+django://default"     # the queue lives in Django's database
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # a charge without an idempotency key is refused at enqueue (ValueError)
    "require_idempotency_key": ["reservations.tasks.charge_payment"],
}
CELERY_TASK_ACKS_LATE = True                 # ack after the task ran
CELERY_TASK_REJECT_ON_WORKER_LOST = True     # a killed worker's task comes back
CELERY_TASK_TIME_LIMIT = 120
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = os.environ.get("CELERY_TASK_ALWAYS_EAGER", "") == "1"
CELERY_TASK_EAGER_PROPAGATES = True

CELERY_BEAT_SCHEDULER = "pgbroker.beat:Scheduler"   # schedule state in PostgreSQL
CELERY_BEAT_SCHEDULE = {
    "expire-reservations-every-minute": {
        "task": "reservations.tasks.expire_reservations",
        "schedule": float(os.environ.get("EXPIRE_EVERY_SECONDS", "60")),
    },
}

# .delay() inside transaction.atomic() is written in that transaction: no on_commit needed
PGBROKER_JOIN_ATOMIC = True
# ends the broker's sessions on the test database before Django drops it
TEST_RUNNER = "pgbroker.contrib.django.testing.DiscoverRunner"
