"""The Celery app of the chaos scenarios that stop the database: ``tests.apps.e2e_app`` plus a task
whose own write survives a restart.

``tests.apps.e2e_app.touch`` records its run with one INSERT; when the server restarts under it that
INSERT fails, the task raises and its job ends ``dead`` -- correctly, but then the scenario
measures the application's failure, not the broker's. ``sturdy_touch`` retries its own write
until the server is back (what an application does with ``autoretry_for``), so the counts of
the scenario are the broker's alone. ``hold`` is ``nap`` for workers under libfaketime;
``eta_seen`` records the ``eta`` its request shows (the clock-skew tests). A worker
gets them with ``celery -A tests.apps.e2e_app worker --include tests.chaos.app``
(``tests.chaos.load.CHAOS_TASKS``).
"""

from __future__ import annotations

import select
import time

import psycopg

from tests.apps.e2e_app import app, record  # the worker finds ``app`` here

__all__ = ["app", "eta_seen", "hold", "sturdy_touch"]


@app.task(bind=True)
def sturdy_touch(self, key: str) -> str:
    deadline = time.monotonic() + 120
    while True:
        try:
            record(self, key)  # tests.apps.e2e_app reconnects when its connection is closed
            return key
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@app.task(bind=True)
def hold(self, key: str, seconds: float) -> str:
    """``nap`` without ``time.sleep``: libfaketime (tests/chaos/test_clock_skew.py) sometimes
    turns Python's absolute-deadline ``clock_nanosleep`` into EINVAL; poll(2) waits relative."""
    record(self, key)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        select.poll().poll(left * 1000)
    record(self, key + ":done")
    return key


@app.task(bind=True)
def eta_seen(self, key: str) -> str:
    """Records ``<key>|<the eta of its request>``."""
    record(self, f"{key}|{self.request.eta}")
    return key
