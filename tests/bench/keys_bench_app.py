"""The Celery app of the job-keys bench (tests/bench/test_job_keys_bench.py), importable as a
top-level module by a worker of either source tree (main's or this branch's pgbroker): it
imports nothing of tests/.

``python keys_bench_app.py <n> [<keys>]`` (run with the tree's pgbroker first on sys.path)
migrates the database of PGBROKER_TEST_BROKER_URL and enqueues ``n`` no-op tasks, spread over
``keys`` concurrency keys (limit 1) if given.
"""

from __future__ import annotations

import os
import sys

import psycopg
from celery import Celery

import pgbroker
from pgbroker._pg.local_server import normalize_url
from pgbroker.migrate import migrate

BROKER_URL = os.environ["PGBROKER_TEST_BROKER_URL"]

app = Celery("keysbench", broker=BROKER_URL)
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=4, task_ignore_result=True,
                broker_connection_retry_on_startup=True)


@app.task(name="bench.noop")
def noop(n: int) -> None:
    return None


def main(n: int, keys: int = 0) -> None:
    url = normalize_url(BROKER_URL)
    migrate(url)
    with psycopg.connect(url) as conn:
        pgbroker.enqueue_many(conn, [
            ("bench.noop", (i,), None, {"concurrency_key": f"k{i % keys}"} if keys else None)
            for i in range(n)], app=app)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
