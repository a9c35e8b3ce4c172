"""A task name pauses itself only on losses whose evidence points to it (issue 27, item 3;
0019_loss_evidence.sql): the rows a crashed or stopped worker leaves, one sweeper pass at the
time the test chooses (``Sweeper.run_once(now=...)``), and the pool-process losses a worker's
main process reports.

* a whole worker lost again and again (same host) pauses nothing, however often;
* a worker told to stop (``consumers.stopping_at``) and then lost counts against nothing;
* the same task taking down different workers in a row, none told to stop, pauses it;
* deliveries in a row that killed their pool process (Celery's WorkerLostError) pause it.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgbroker._pg.store import Store
from pgbroker.sweeper import Sweeper
from tests.support.db import db_now, disk_full_when

TASK = "app.tasks.report"


def lost_worker(pg: psycopg.Connection, host: str, jobs: int = 2,
                stopping: bool = False) -> list[tuple[uuid.UUID, int]]:
    """What a SIGKILLed worker on ``host`` leaves: its consumer row (told to stop first when
    ``stopping``), and ``jobs`` running jobs of TASK it had claimed."""
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues, stopping_at) "
               "VALUES (%s, %s, 4242, '{celery}', CASE WHEN %s THEN now() END)",
               (consumer, host, stopping))
    ids = [uuid.uuid4() for _ in range(jobs)]
    for job in ids:
        pg.execute("INSERT INTO pgbroker.jobs (id, queue, task, body, state, attempts, "
                   "max_attempts, locked_by, locked_at) VALUES (%s, 'celery', %s, '\\x7b7d', "
                   "'running', 1, 50, %s, now())", (job, TASK, consumer))
    return [(job, 1) for job in ids]


def sweep_after_lease(store: Store, pg: psycopg.Connection) -> int:
    """One pass once every heartbeat is older than the lease; the jobs it rescued."""
    now: datetime = db_now(pg) + timedelta(seconds=store.settings.lease_timeout + 1)
    return Sweeper(store).run_once(now=now).rescued


def losses(pg: psycopg.Connection) -> dict[str, dict[str, Any]]:
    rows = pg.cursor(row_factory=dict_row).execute("SELECT * FROM pgbroker.task_losses")
    return {r["task"]: r for r in rows}


def pauses(pg: psycopg.Connection) -> dict[str, dict[str, Any]]:
    rows = pg.cursor(row_factory=dict_row).execute("SELECT * FROM pgbroker.task_pauses")
    return {r["task"]: r for r in rows}


def test_one_worker_lost_again_and_again_pauses_nothing(store: Store,
                                                        pg: psycopg.Connection) -> None:
    assert store.settings.pause_task_after == 5
    for _ in range(6):  # six kills of the same worker (restarted each time), two jobs each
        lost_worker(pg, "node-a")
        assert sweep_after_lease(store, pg) == 2
        pg.execute("UPDATE pgbroker.jobs SET state = 'completed' WHERE state = 'pending'")
    assert not pauses(pg)
    streak = losses(pg)[TASK]
    assert (streak["streak"], streak["workers"]) == (0, ["node-a"])


def test_a_worker_told_to_stop_then_killed_counts_against_nothing(
        store: Store, pg: psycopg.Connection) -> None:
    for host in ("node-a", "node-b", "node-c", "node-d", "node-e", "node-f"):
        lost_worker(pg, host, stopping=True)  # a rolling deploy whose grace period ran out
        assert sweep_after_lease(store, pg) == 2
    assert not losses(pg) and not pauses(pg)
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE state = 'pending'"
                      ).fetchone() == (12,)  # redelivered all the same


def test_taking_down_different_workers_in_a_row_pauses_the_task(
        store: Store, pg: psycopg.Connection) -> None:
    for host in ("node-a", "node-a", "node-b", "node-a", "node-c", "node-d"):
        lost_worker(pg, host, jobs=1)
        sweep_after_lease(store, pg)
    assert not pauses(pg)
    assert losses(pg)[TASK]["workers"] == ["node-a", "node-b", "node-c", "node-d"]
    lost_worker(pg, "node-b", jobs=1)  # seen already: adds nothing
    sweep_after_lease(store, pg)
    assert not pauses(pg)
    lost_worker(pg, "node-e", jobs=1)
    sweep_after_lease(store, pg)
    pause = pauses(pg)[TASK]
    assert pause["paused_by"] == "pgbroker"
    assert pause["reason"].startswith(
        "took down 5 different workers in a row (node-a, node-b, node-c, node-d, node-e: each "
        "lost as a whole while running it, none told to stop): jobs ")
    assert len(pause["job_ids"]) == 8
    assert all(str(j) in pause["reason"] for j in pause["job_ids"])


def test_deliveries_that_killed_their_pool_process_pause_the_task(
        store: Store, pg: psycopg.Connection) -> None:
    deliveries = lost_worker(pg, "node-a", jobs=5)  # running: their pool processes die
    for delivery in deliveries[:3]:
        store.record_losses([delivery])
    store.record_losses([deliveries[3]] * 2)  # (one delivery reported twice is one loss)
    assert (losses(pg)[TASK]["streak"], losses(pg)[TASK]["workers"]) == (4, [])
    assert not pauses(pg)
    store.record_losses(deliveries[4:])
    reason = pauses(pg)[TASK]["reason"]
    assert reason.startswith("5 deliveries in a row killed their pool process (Celery's "
                             "WorkerLostError: killed, out of memory or exited): jobs ")
    assert all(str(job) in reason for job, _ in deliveries)


def test_a_loss_record_that_meets_a_full_disk_is_written_again(
        store: Store, pg: psycopg.Connection) -> None:
    """The loss is recorded as failures are: a statement that failed on a living connection
    (53100, twice here) is sent again, and the loss counts."""
    pg.execute("CREATE SEQUENCE public.full_disk")
    disk_full_when(pg, "pgbroker.task_losses", "nextval('public.full_disk') <= 2")
    deliveries = lost_worker(pg, "node-a", jobs=1)
    store.record_losses(deliveries)
    assert pg.execute("SELECT last_value FROM public.full_disk").fetchone() == (3,)
    assert losses(pg)[TASK]["streak"] == 1
