"""The Celery app of the beat end-to-end tests: one 1-second entry, pgbroker's scheduler.

``celery -A tests.apps.beat_app beat`` uses ``pgbroker.beat:Scheduler`` from the config (no ``-S``
needed); the entry's options come from ``PGBROKER_TEST_BEAT_OPTIONS`` (JSON, default
``{"overlap": "allow"}``, so that jobs nobody consumes never hold occurrences back). The task
records the occurrence it was fired for, read from ``self.request``, in ``public.runs``.
"""

from __future__ import annotations

import json
import os

from celery import Celery

import pgbroker  # noqa: F401 - registers pgbroker://
from tests.apps.e2e_app import BROKER_URL, record

TICK = "tests.apps.beat_app.tick"

app = Celery("beatapp", broker=BROKER_URL)
app.conf.update(
    beat_scheduler="pgbroker.beat:Scheduler",
    broker_connection_retry_on_startup=True,
    result_expires=None,  # no celery.backend_cleanup entry: only "tick" is scheduled
    beat_schedule={"tick": {
        "task": TICK, "schedule": 1.0,
        "options": json.loads(os.environ.get("PGBROKER_TEST_BEAT_OPTIONS",
                                             '{"overlap": "allow"}'))}},
)


@app.task(bind=True)
def tick(self) -> str:
    occurrence = self.request.pgbroker_occurrence  # the header beat sets, on task.request
    record(self, occurrence)
    return occurrence
