"""The shutdown paths of a real ``celery worker`` over pgbroker, each started by its signal:
warm (SIGTERM), soft (SIGQUIT with ``worker_soft_shutdown_timeout``, Celery 5.5+) and cold
(SIGQUIT without it).

Whatever the path, a prefetched message that has not started is given back by the stopping
worker itself (``pending`` the moment the worker has exited: the lease here is 300 s, so no
sweeper can have done it), and an eta task is never lost: it waits in the database as
``scheduled`` (never in the worker's memory, where Celery's docs warn a soft shutdown can lose it
on other brokers, kombu#533) and keeps its ``run_at``.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from typing import Any

import celery
import psycopg
import pytest
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.support.workers import job, key_runs
from tests.support.processes import run_worker, wait_for

#: A lease no test outlives: what is given back, the stopping worker gave back.
LONG_LEASE = {"lease_timeout": 300, "heartbeat_interval": 5}
PREFETCHED = ("pre-1", "pre-2")

soft_shutdown = pytest.mark.skipif(celery.VERSION < (5, 5),
                                   reason="soft shutdown came with Celery 5.5")


@dataclass
class Stopped:
    """What a shutdown left: the exit status, the seconds from the signal to the exit, and the
    job rows of the running task, the prefetched ones and the eta task, as they were then."""

    status: int
    seconds: float
    running: dict[str, Any]
    prefetched: list[dict[str, Any]]
    eta: dict[str, Any]
    eta_run_at: Any


def _shutdown(broker_url: str, runs: psycopg.Connection, sig: int, nap: float | None,
              **conf: Any) -> Stopped:
    """A worker (one process, prefetch 3) running a ``nap`` of ``nap`` seconds (none: idle) with
    two naps prefetched behind it and an eta task waiting, stopped by ``sig``."""
    if nap is not None:
        e2e.nap.apply_async(("running", nap), task_id="running")
        for key in PREFETCHED:
            e2e.nap.apply_async((key, 0.1), task_id=key)
    e2e.touch.apply_async(("eta",), task_id="eta", countdown=600)
    run_at = job(runs, "eta")["run_at"]
    worker = run_worker("tests.e2e.shutdown_app", broker_url, "-c", "1",
                        "--prefetch-multiplier", "3",
                        env={"PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(LONG_LEASE),
                             "PGBROKER_TEST_CELERY_CONF": json.dumps(conf)})
    worker.wait_ready(60)
    if nap is not None:
        wait_for(lambda: key_runs(runs, "running") and all(
            job(runs, key)["state"] == "running" for key in PREFETCHED), 60,
            message="the nap to run and the two behind it to be prefetched")
    start = time.monotonic()
    worker.kill(sig)
    status = worker.wait(120)
    seconds = time.monotonic() - start
    print(f"\n[figure] {signal.Signals(sig).name} {conf or ''}: exited {status} "
          f"after {seconds:.1f} s")
    rows = {key: job(runs, key) for key in ("eta", *(() if nap is None else
                                                      ("running", *PREFETCHED)))}
    return Stopped(status, seconds, rows.get("running", {}),
                   [rows[key] for key in PREFETCHED if key in rows], rows["eta"], run_at)


def _nothing_lost(runs: psycopg.Connection, stopped: Stopped) -> None:
    """The prefetched naps given back unstarted, the eta task still waiting as it was."""
    for row in stopped.prefetched:
        assert row["state"] == "pending" and key_runs(runs, row["task_id"]) == [], row
        assert "restored" in row["last_error"]  # by the stopping worker, not a sweeper
    assert (stopped.eta["state"], stopped.eta["run_at"], stopped.eta["attempts"]) == (
        "scheduled", stopped.eta_run_at, 0)


def test_warm_shutdown_finishes_the_running_task_and_gives_back_the_rest(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    stopped = _shutdown(broker_url, runs, signal.SIGTERM, nap=3)
    assert stopped.status == 0
    assert stopped.running["state"] == "completed"
    _nothing_lost(runs, stopped)


def test_cold_shutdown_gives_back_the_running_task_and_the_rest_at_once(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    stopped = _shutdown(broker_url, runs, signal.SIGQUIT, nap=120)
    assert stopped.seconds < 60  # the nap was not waited for
    assert stopped.running["state"] == "pending"  # acks_late: it runs again elsewhere
    assert [run["key"] for run in key_runs(runs, "running")] == ["running"]
    _nothing_lost(runs, stopped)


@soft_shutdown
@pytest.mark.parametrize(("nap", "timeout", "state"), [(2, 5, "completed"), (120, 3, "pending")],
                         ids=["a short task finishes", "a long task is given back"])
def test_soft_shutdown_waits_its_timeout_for_the_running_task(
        producer: Celery, runs: psycopg.Connection, broker_url: str, nap: float, timeout: float,
        state: str) -> None:
    stopped = _shutdown(broker_url, runs, signal.SIGQUIT, nap=nap,
                        worker_soft_shutdown_timeout=timeout)
    assert timeout <= stopped.seconds < 60  # worker_soft_shutdown_timeout honoured, no more
    assert stopped.running["state"] == state
    assert bool(key_runs(runs, "running:done")) == (state == "completed")
    _nothing_lost(runs, stopped)


@soft_shutdown
def test_soft_shutdown_of_an_idle_worker_keeps_its_eta_task(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    # worker_enable_soft_shutdown_on_idle exists for Redis, to requeue the eta tasks a worker
    # holds in memory; here the eta task never left the database
    stopped = _shutdown(broker_url, runs, signal.SIGQUIT, nap=None,
                        worker_soft_shutdown_timeout=2, worker_enable_soft_shutdown_on_idle=True)
    assert stopped.seconds >= 2
    _nothing_lost(runs, stopped)
