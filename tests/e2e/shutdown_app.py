"""``tests.apps.e2e_app`` with the Celery settings a test gives in ``PGBROKER_TEST_CELERY_CONF``
(JSON): ``worker_soft_shutdown_timeout``, ``worker_enable_soft_shutdown_on_idle`` (Celery 5.5+),
which no ``celery worker`` option sets; ``task_acks_late`` and ``worker_disable_prefetch``
(tests/e2e/test_prefetch.py: its option came with Celery 5.6)."""

from __future__ import annotations

import json
import os

from tests.apps.e2e_app import app

__all__ = ["app"]

app.conf.update(json.loads(os.environ.get("PGBROKER_TEST_CELERY_CONF", "{}")))
