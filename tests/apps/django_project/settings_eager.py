"""The test project in Celery's eager mode (``CELERY_TASK_ALWAYS_EAGER``), as many Django test
suites run Celery; the broker on Django's database."""

from __future__ import annotations

from .settings import *  # noqa: F403 - the test project's settings, eager

CELERY_BROKER_URL = "pgbroker+django://default"
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_EAGER_PROPAGATES = True
