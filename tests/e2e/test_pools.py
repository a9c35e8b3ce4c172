"""The heavy pool of seed 001 (issue 22, point 6) over pgbroker: one job per pool process at a
time, and a process that grew past ``--max-memory-per-child`` is replaced after its job -- which
is completed once, not taken for a lost worker (no redelivery, no loss counted)."""

from __future__ import annotations

import psycopg
from celery import Celery

from tests.e2e.jobsem_support import producer, worker  # noqa: F401 - fixture
from tests.support.workers import SHORT_LEASE
from tests.support.processes import wait_for

OPTIONS = SHORT_LEASE


def test_a_process_over_its_memory_cap_is_replaced_after_its_job(
        producer: Celery, broker_url: str, pg: psycopg.Connection) -> None:  # noqa: F811
    heavy = worker(broker_url, OPTIONS, "-c", "1", "--prefetch-multiplier", "1",
                   "--max-memory-per-child", "100000")   # KiB: ~100 MB
    before = set(heavy.child_pids())
    producer.send_task("tests.e2e.jobsem_app.hog", ("big", 200), task_id="big")
    wait_for(lambda: pg.execute("SELECT state FROM pgbroker.jobs WHERE task_id = 'big'"
                                ).fetchone() == ("completed",), 60)
    wait_for(lambda: set(heavy.child_pids()) - before, 30,
             message="a new pool process, the old one over its cap replaced")
    assert not before & set(heavy.child_pids())
    producer.send_task("tests.e2e.jobsem_app.hog", ("small", 1), task_id="small")
    wait_for(lambda: pg.execute("SELECT state FROM pgbroker.jobs WHERE task_id = 'small'"
                                ).fetchone() == ("completed",), 60)
    heavy.stop()
    assert pg.execute("SELECT attempts FROM pgbroker.jobs WHERE task_id = 'big'").fetchone() == (1,)
    assert pg.execute("SELECT count(*) FROM public.runs WHERE key = 'big'").fetchone() == (1,)
    assert pg.execute("SELECT count(*) FROM pgbroker.task_losses").fetchone() == (0,)
