"""A statement that fails on a living connection is not a lost worker (issue 27, item 1).

psycopg raises ``OperationalError`` for a full disk (53100) as for a lost connection. A worker
that took the one for the other restarted its consumer at every failed ack: each restart
registered a new consumer and claimed new jobs it could not ack either, the jobs stayed
'running' under consumers that no longer existed, and the sweeper ran them again as "lost" --
until their task type paused itself. The fault here is deterministic: a trigger raises the
SQLSTATE of a full disk when a job would become 'completed' (every ack fails, claims do not).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery
from prometheus_client import generate_latest

from pgbroker import health
from pgbroker.metrics import MetricsReader, prometheus_registry
from tests.apps import e2e_app as e2e
from tests.support.workers import SHORT_LEASE, start_worker
from tests.support.processes import wait_for

DISK_FULL = """
CREATE FUNCTION public.disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state = 'running' AND NEW.state = 'completed' THEN
        RAISE EXCEPTION 'could not extend file "base/1/2": No space left on device'
            USING ERRCODE = 'disk_full';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER disk_full BEFORE UPDATE ON pgbroker.jobs
    FOR EACH ROW EXECUTE FUNCTION public.disk_full();
"""


@pytest.fixture
def disk_full(runs: psycopg.Connection) -> Iterator[psycopg.Connection]:
    runs.execute(DISK_FULL)
    yield runs
    runs.execute("DROP TRIGGER IF EXISTS disk_full ON pgbroker.jobs")


def states(pg: psycopg.Connection) -> dict[str, int]:
    return dict(pg.execute("SELECT state, count(*) FROM pgbroker.jobs GROUP BY state").fetchall())


def test_acks_that_fail_on_a_full_disk_run_nothing_twice_and_pause_nothing(
        producer: Celery, disk_full: psycopg.Connection, broker_url: str) -> None:
    pg = disk_full
    n = 30
    worker = start_worker(broker_url, "-c", "2", options=SHORT_LEASE)
    for i in range(n):
        e2e.touch.delay(f"k{i}")
    wait_for(lambda: pg.execute("SELECT count(*) FROM public.runs").fetchone()[0] >= n, 60,
             message="every task to run once")
    # the fault outlasts the lease three times over: a worker taken for lost would see its
    # jobs rescued and run again within one lease
    consumers = [r[0] for r in pg.execute("SELECT id FROM pgbroker.consumers")]
    began = pg.execute("SELECT clock_timestamp()").fetchone()[0]
    wait_for(lambda: pg.execute("SELECT clock_timestamp() - %s > make_interval(secs => %s)",
                                (began, 3 * SHORT_LEASE["lease_timeout"])).fetchone()[0],
             60, interval=0.2, message="three leases under the fault")
    assert states(pg) == {"running": n}, states(pg)
    # said where an operator looks: the worker's health, /metrics (its heartbeat writes it)
    wait_for(lambda: health.worker(pg, consumer=consumers[0], max_settle_failing=0).status
             == "failing", 30, message="the worker's health to say its acks fail")
    verdict = health.worker(pg, consumer=consumers[0], max_settle_failing=0)
    assert "SQLSTATE 53100" in verdict.reason, verdict
    text = generate_latest(prometheus_registry(
        lambda: MetricsReader(lag=0).snapshot(pg))).decode()
    assert f'pgbroker_consumer_settle_failing_seconds{{consumer="{consumers[0]}"' in text
    pg.execute("DROP TRIGGER disk_full ON pgbroker.jobs")  # the disk is freed
    wait_for(lambda: states(pg) == {"completed": n}, 30,
             message=lambda: f"every job to complete ({states(pg)})")

    runs = pg.execute("SELECT key, count(*) FROM public.runs GROUP BY key").fetchall()
    assert len(runs) == n and all(count == 1 for _, count in runs), runs
    assert pg.execute("SELECT max(attempts) FROM pgbroker.jobs").fetchone()[0] == 1
    assert pg.execute("SELECT count(*) FROM pgbroker.task_pauses").fetchone()[0] == 0
    # one consumer all along: never restarted into new claims
    assert [r[0] for r in pg.execute("SELECT id FROM pgbroker.consumers")] == consumers
    assert len(consumers) == 1
    assert "Connection to broker lost" not in worker.log()
    assert "SQLSTATE 53100" in worker.log()  # the WARNING that names the fault
    worker.wait_for_log("delivery updates are written again", 30)
    wait_for(lambda: health.worker(pg, consumer=consumers[0], max_settle_failing=0).status
             == "ok", 30, message="the worker's health to be ok again")
    assert worker.is_alive()
