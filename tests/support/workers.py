"""Workers and SQL look-ups shared by the tests that run real ``celery worker``s (the e2e and
chaos tiers). A job's row is read with :mod:`tests.support.db` (:func:`job` is here too, for
the tests that import it with the rest).

Their fixtures (``runs``, ``producer``: ``tests.apps.e2e_app.app`` pointed at the test's database)
are in :mod:`tests.support.fixtures`, loaded for every tier. Every figure a test reads (run
times, latencies) comes from the database clock.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tests.support.db import counts as jobs_by_state
from tests.support.db import job
from tests.support.processes import WorkerProcess, run_worker, wait_for

__all__ = [
    "job",
    "jobs_by_state",
    "key_runs",
    "owner_of",
    "percentile",
    "start_worker",
    "wait_done",
    "wait_state",
]

#: Transport options that make leases expire within seconds (heartbeat 1 s, sweep every second).
SHORT_LEASE = {"lease_timeout": 3, "heartbeat_interval": 1, "sweep_interval": 1}


def start_worker(broker_url: str, *args: str, options: Mapping[str, Any] | None = None,
                 ready: bool = True, app: str = "tests.apps.e2e_app") -> WorkerProcess:
    """A ``celery worker`` of ``app`` (``-c 2`` unless ``args`` says otherwise) with these
    transport options; waits for its ``ready.`` line unless ``ready`` is False."""
    env = {"PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(dict(options))} if options else None
    worker = run_worker(app, broker_url, *args, env=env)
    return worker.wait_ready(60) if ready else worker


def key_runs(pg: psycopg.Connection, key: str) -> list[dict[str, Any]]:
    """The runs recorded under ``key``, oldest first."""
    return pg.cursor(row_factory=dict_row).execute(
        "SELECT * FROM public.runs WHERE key = %s ORDER BY n", (key,)).fetchall()


def wait_state(pg: psycopg.Connection, task_id: str, state: str,
               timeout: float = 60) -> dict[str, Any]:
    """Wait until the job of ``task_id`` is in ``state``; return its row."""
    return wait_for(lambda: (row := job(pg, task_id))["state"] == state and row, timeout,
                    interval=0.05, message=lambda: f"job {task_id} to be {state} "
                    f"(it is {job(pg, task_id)['state']})")


def wait_done(pg: psycopg.Connection, keys: list[str], timeout: float) -> None:
    """Wait until every key has a ``<key>:done`` run (a ``nap`` that finished)."""
    wanted = [k + ":done" for k in keys]

    def missing() -> int:
        row = pg.execute("SELECT count(DISTINCT key) FROM public.runs WHERE key = ANY(%s)",
                         (wanted,)).fetchone()
        return len(wanted) - row[0]

    wait_for(lambda: missing() == 0, timeout, interval=0.1,
             message=lambda: f"every nap to finish ({missing()} of {len(wanted)} missing)")


def owner_of(pid: int, *workers: WorkerProcess) -> WorkerProcess:
    """The worker whose pool child (or main process) has ``pid``."""
    for worker in workers:
        if pid == worker.pid or pid in worker.child_pids():
            return worker
    raise AssertionError(f"pid {pid} belongs to none of {workers}")


def percentile(values: list[float], pct: float) -> float:
    """The ``pct`` percentile (nearest rank on the sorted values)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(pct) - 1]
