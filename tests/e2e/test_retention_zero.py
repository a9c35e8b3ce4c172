"""``retention: 0`` (delete on ack) under a real worker with acks late and prefetch x1.

Its acks are written at once instead of riding on the next claim; the worker used to wait for
its next poll (``poll_interval``) before claiming again, so it ran a task per poll (found by
the capacity bench of issue 20: 6 tasks in 15 s).
"""

from __future__ import annotations

import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.support.workers import start_worker
from tests.support.processes import wait_for


def test_a_retention_zero_worker_claims_again_after_each_ack(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    start_worker(broker_url, "-c", "2", options={"retention": 0, "poll_interval": 60})
    keys = [f"r0-{i}" for i in range(30)]
    for key in keys:
        e2e.touch.apply_async((key,), task_id=key)
    # at one task per 60 s poll this would take half an hour; claims after acks take seconds
    wait_for(lambda: runs.execute("SELECT count(DISTINCT key) FROM public.runs WHERE key ="
                                  " ANY(%s)", (keys,)).fetchone()[0] == len(keys), 45,
             interval=0.2, message="every task run")
    wait_for(lambda: runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 0, 15,
             message="every job deleted on ack")
