"""End to end: fanout exchanges with real ``celery worker`` processes.

A message to a fanout exchange waits in every bound queue, as on RabbitMQ, even when no worker
runs at publish time; Celery's ``Broadcast`` queues (auto-delete, one per worker) still get each
message once per worker listening.
"""

from __future__ import annotations

import kombu
import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.e2e.fanout_app import FANOUT
from tests.support.workers import key_runs
from tests.support.processes import run_worker, wait_for


def test_a_fanout_message_waits_in_every_bound_queue_and_broadcasts_reach_every_worker(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    with producer.connection_for_write() as conn:  # the queues exist, as a deploy declares them
        for name in ("fan_a", "fan_b"):
            kombu.Queue(name, FANOUT)(conn.default_channel).declare()
    e2e.touch.apply_async(("fan-early",), exchange="fan_x", routing_key="any")
    assert sorted(runs.execute("SELECT queue, state FROM pgbroker.jobs").fetchall()) == [
        ("fan_a", "pending"), ("fan_b", "pending")]

    workers = [run_worker("tests.e2e.fanout_app", broker_url, "-c", "1",
                          env={"PGBROKER_TEST_FANOUT_QUEUE": name})
               for name in ("fan_a", "fan_b")]
    for worker in workers:
        worker.wait_ready(60)
    ran = wait_for(lambda: len(found := key_runs(runs, "fan-early")) == 2 and found, 60,
                   message="the fanout message to run once from each queue")
    assert {run["pid"] for run in ran} == {pid for w in workers for pid in w.child_pids()}

    e2e.touch.apply_async(("bcast-1",), exchange="bcast_x", routing_key="any")
    ran = wait_for(lambda: len(found := key_runs(runs, "bcast-1")) == 2 and found, 60,
                   message="the broadcast to run once on each worker")
    assert {run["pid"] for run in ran} == {pid for w in workers for pid in w.child_pids()}
    # a broadcast queue holds no job: what no worker listened for is gone, as on RabbitMQ
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs WHERE queue LIKE 'bcast.%'"
                        ).fetchone()[0] == 0
