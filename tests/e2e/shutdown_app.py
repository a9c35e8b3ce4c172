"""``tests.e2e.app`` with the Celery settings a shutdown test gives in
``PGBROKER_TEST_CELERY_CONF`` (JSON): ``worker_soft_shutdown_timeout``,
``worker_enable_soft_shutdown_on_idle`` (Celery 5.5+), which no ``celery worker`` option sets."""

from __future__ import annotations

import json
import os

from tests.e2e.app import app

__all__ = ["app"]

app.conf.update(json.loads(os.environ.get("PGBROKER_TEST_CELERY_CONF", "{}")))
