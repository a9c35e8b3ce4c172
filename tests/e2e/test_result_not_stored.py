"""A success whose result cannot be stored never ends ``completed`` without its result (issue 27,
item 2), with a real ``celery worker`` (acks late) and the pgbroker result backend.

The fault is a disk-full error (SQLSTATE 53100) raised by a ``BEFORE`` trigger on
``pgbroker.results``, for chosen task ids only:

* ``full-*``: every write of the task's result fails, the SUCCESS and then the FAILURE that Celery
  tries to store instead, as on a full disk;
* ``blip-*``: the first two writes fail (a sequence per task id counts them: ``nextval`` is not
  undone when the statement fails), then the disk has room again.

Each job must end ``completed`` with its result readable, or ``dead`` saying that the task
succeeded but its result could not be stored; ``AsyncResult.get(timeout=...)`` returns or
raises, never waits on PENDING.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery

from pgbroker.errors import JobDead
from tests.apps import e2e_app as e2e
from tests.apps import results_app
from tests.support.db import counts, disk_full_when
from tests.support.processes import run_worker, wait_for

NAME = "tests.apps.results_app."
REASON = "the task succeeded but its result could not be stored: 53100 disk full (test)"

#: Which writes of a result meet a full disk (see the module docstring).
FULL = ("NEW.task_id LIKE 'full-%' OR coalesce(nextval(to_regclass("
        "format('public.%I', NEW.task_id))) <= 2, false)")


@pytest.fixture
def client(broker_url: str, pg: psycopg.Connection) -> Iterator[Celery]:
    """The producer; its waiters re-read pending results twice a second (a dead job's reason
    is read from its row: no NOTIFY says so)."""
    pg.execute(e2e.RUNS_DDL)
    with results_app.producer(broker_url, poll_interval=0.5) as app:
        yield app


def test_a_success_is_stored_or_its_job_ends_dead_with_the_reason(
        client: Celery, broker_url: str, pg: psycopg.Connection) -> None:
    disk_full_when(pg, "pgbroker.results", FULL)
    for i in range(3):
        pg.execute(f'CREATE SEQUENCE public."blip-{i}"')
    worker = run_worker("tests.apps.results_app", broker_url, "-c", "2").wait_ready(60)
    add = client.tasks[NAME + "add"]
    full = [add.apply_async((i, 1), task_id=f"full-{i}") for i in range(3)]
    blips = [add.apply_async((i, 2), task_id=f"blip-{i}") for i in range(3)]
    fine = [add.apply_async((i, 3), task_id=f"fine-{i}") for i in range(3)]

    started = time.monotonic()
    for res in full:
        with pytest.raises(JobDead, match=re.escape(REASON)):
            res.get(timeout=30)
        assert res.state == "FAILURE"
    print(f"\n[figure] results never storable: get() raised JobDead for all 3 within "
          f"{time.monotonic() - started:.1f} s of publishing")
    assert [res.get(timeout=30) for res in blips] == [2, 3, 4]
    assert [res.get(timeout=30) for res in fine] == [3, 4, 5]

    # a result is stored by the pool process a moment before the main process acks its job
    wait_for(lambda: not {"pending", "running"} & counts(pg).keys(), 30,
             message=lambda: f"every job settled ({counts(pg)})")
    jobs = dict(((task_id, (state, error)) for task_id, state, error in pg.execute(
        "SELECT task_id, state, last_error FROM pgbroker.jobs")))
    assert {t: jobs[t] for t in jobs if t.startswith("full-")} == {
        f"full-{i}": ("dead", REASON) for i in range(3)}
    assert all(jobs[t] == ("completed", None) for t in jobs if not t.startswith("full-"))
    stored = dict(pg.execute("SELECT task_id, status FROM pgbroker.results").fetchall())
    assert stored == {**{f"blip-{i}": "SUCCESS" for i in range(3)},
                      **{f"fine-{i}": "SUCCESS" for i in range(3)}}
    worker.stop()
