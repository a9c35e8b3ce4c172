"""What the sweeper logs: a warning when it takes jobs from lost consumers, and only then.

Forgetting a consumer that held no job (a `celery inspect` client that exited without closing
its connection) is routine and logged at DEBUG: tests/e2e/test_quiet_clients.py runs the real
clients against a real worker.
"""

from __future__ import annotations

import logging
import uuid

import psycopg
import pytest

from pgbroker.sweeper import Sweeper
from tests.support.db import add_job
from tests.support.transport import store_for


def lost_consumer(pg: psycopg.Connection, host: str = "gone-host") -> uuid.UUID:
    """A consumer row on ``host`` whose session lock nobody holds: its connection is gone."""
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues, lock_key)"
               " VALUES (%s, %s, 1, '{q1}', 4242)", (consumer, host))
    return consumer


def test_the_sweeper_warns_when_it_rescues_jobs_and_not_when_it_forgets_idle_consumers(
        db_url: str, pg: psycopg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    store = store_for(db_url)
    try:
        with caplog.at_level(logging.DEBUG, logger="pgbroker.sweeper"):
            lost_consumer(pg)
            assert Sweeper(store).run_once().consumers == 1
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            caplog.clear()
            add_job(pg, "running", locked_by=lost_consumer(pg))
            result = Sweeper(store).run_once()
        assert (result.rescued, result.consumers) == (1, 1)
        [record] = caplog.records
        assert record.levelno == logging.WARNING
        assert "1 job(s) of lost consumers redelivered" in record.getMessage()
    finally:
        store.close()
