"""The test project with the broker on Django's own database (``pgbroker+django://default``,
which follows ``manage.py test`` to its test database) and ``.delay()`` joining ``atomic()``."""

from __future__ import annotations

from .settings import *  # noqa: F403 - the test project's settings, two of them changed

CELERY_BROKER_URL = "pgbroker+django://default"
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
PGBROKER_JOIN_ATOMIC = True
