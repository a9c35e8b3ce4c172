"""End to end: jobs written from asyncio code -- ``await pgbroker.aenqueue``,
``await pgbroker.aenqueue_many`` and ``.delay()`` inside ``async with pgbroker.atransaction`` --
in the caller's transaction, run by a real ``celery worker`` of ``tests.apps.e2e_app``.

As in test_enqueue_worker.py the worker polls only every 60 s, so a job that runs within the 30 s
wait was woken by the NOTIFY its commit delivered.
"""

from __future__ import annotations

import asyncio

import psycopg
from celery import Celery

import pgbroker
from tests.apps import e2e_app as e2e
from tests.support.workers import key_runs, start_worker
from tests.support.processes import wait_for
from tests.support.enqueue import ASYNC_KINDS, opened

NO_POLLING = {"poll_interval": 60}


def test_jobs_written_from_asyncio_run_once_the_transaction_commits(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    worker = start_worker(broker_url, options=NO_POLLING)

    async def application(number: int, kind: str) -> None:
        async with opened(kind, db_url) as caller:
            await pgbroker.aenqueue(caller.db, e2e.touch, (f"awaited-{kind}",))
            await pgbroker.aenqueue_many(caller.db, [(e2e.add, (number, i)) for i in range(3)])
            async with pgbroker.atransaction(caller.db):
                e2e.touch.delay(f"delayed-{kind}")
            await asyncio.sleep(1.0)  # the worker is idle and listening: it must not see them
            assert key_runs(runs, f"awaited-{kind}") == []
            await caller.commit()
            for key in (f"awaited-{kind}", f"delayed-{kind}",
                        *(f"add:{number}:{i}" for i in range(3))):
                wait_for(lambda key=key: key_runs(runs, key), 30,
                         message=f"the run of {key} after its commit")

            await pgbroker.aenqueue(caller.db, e2e.touch, (f"rolled-back-{kind}",))
            async with pgbroker.atransaction(caller.db):
                e2e.touch.delay(f"rolled-back-{kind}")
            await caller.rollback()

    for number, kind in enumerate(ASYNC_KINDS):
        asyncio.run(application(number, kind))
    # A job committed after the rollbacks has run, so a rolled back one would have run too.
    with psycopg.connect(db_url) as conn:
        pgbroker.enqueue(conn, e2e.touch, ("marker",))
    wait_for(lambda: key_runs(runs, "marker"), 30, message="the marker's run")
    assert all(key_runs(runs, f"rolled-back-{kind}") == [] for kind in ASYNC_KINDS)
    assert "rolled-back" not in worker.log()  # never even received
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 5 * 3 + 1
