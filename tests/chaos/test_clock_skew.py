"""Clock skew: the database's ``now()`` is the clock of leases and of ``run_at``.

A worker's clock is moved an hour ahead or behind with libfaketime (``apt-get install
faketime``; the tests are skipped without it), preloaded into the ``celery worker`` process
and its pool children through ``LD_PRELOAD``/``FAKETIME``. What pgbroker decides -- is a
scheduled job due, is a consumer's lease expired -- is decided in SQL with ``now()``, so the
worker's clock must change nothing of it:

* a job scheduled (``countdown``) by a producer with the right clock is not delivered before
  its ``run_at`` by the database clock, even to a worker whose clock says it is long past;
* a worker whose clock is an hour ahead keeps its lease: its long task is never rescued;
* a worker whose clock is an hour behind runs a due job when the database says it is due.

And the task sees its producer's ``eta`` (``self.request.eta``) exactly, unless the worker's
clock is behind the database's: then it sees the worker's now at delivery, which is what makes
Celery run it at once instead of holding it in a timer until the worker's clock catches up.

Limits that are Celery's, not the transport's (docs/chaos.md): a producer's clock sets the
absolute ``eta`` (Celery sends no countdown), and a worker checks ``expires`` with its own clock.
"""

from __future__ import annotations

import glob
import json
import re
import time
from datetime import datetime

import psycopg
import pytest
from celery import Celery

from tests.chaos.app import eta_seen, hold
from tests.chaos.load import CHAOS_TASKS
from tests.apps import e2e_app as e2e
from tests.support.workers import SHORT_LEASE, job, key_runs, start_worker, wait_state
from tests.support.processes import WorkerProcess, run_worker, wait_for

_LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
                      + glob.glob("/usr/local/lib/faketime/libfaketime.so.1"))
pytestmark = pytest.mark.skipif(not _LIBFAKETIME, reason="libfaketime is not installed "
                                "(apt-get install faketime)")


def skewed_worker(broker_url: str, offset: str, *args: str,
                  options: dict[str, object] | None = None) -> WorkerProcess:
    """A worker (with tests.chaos.app's tasks) whose wall clock is ``offset`` off (``+1h``).
    Monotonic clocks are left alone (kombu's timers use them; only the wall clock skews)."""
    env = {"LD_PRELOAD": _LIBFAKETIME[0], "FAKETIME": offset,
           "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_DONT_RESET": "1",
           "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(options or {})}
    return run_worker("tests.apps.e2e_app", broker_url, *CHAOS_TASKS, *args, env=env).wait_ready(60)


def _worker_clock_offset(worker: WorkerProcess) -> float:
    """About how many seconds the worker's wall clock is off ours (its ``ready.`` line was
    just written, by its own clock)."""
    line = next(text for text in worker.log().splitlines() if "ready." in text)
    stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)[1]  # type: ignore[index]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp() - time.time()


def seen_eta(runs: psycopg.Connection, key: str) -> datetime:
    """The eta the task ``eta_seen(key)`` saw, once it ran."""
    [(seen,)] = wait_for(lambda: runs.execute("SELECT key FROM public.runs WHERE key LIKE %s",
                                              (key + "|%",)).fetchall(),
                         30, message=f"{key} to run")
    return datetime.fromisoformat(seen.split("|", 1)[1])


def sent_eta(runs: psycopg.Connection, task_id: str) -> datetime:
    return datetime.fromisoformat(job(runs, task_id)["headers"]["eta"])


def test_a_worker_an_hour_ahead_waits_for_run_at_and_keeps_its_lease(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    # a worker with the right clock that sweeps every second and consumes nothing under test
    helper = start_worker(broker_url, *CHAOS_TASKS, "-c", "1", "-Q", "standby",
                          options=SHORT_LEASE)
    ahead = skewed_worker(broker_url, "+1h", "-c", "2", options=SHORT_LEASE)
    assert _worker_clock_offset(ahead) > 3000, "libfaketime did not skew the worker's clock"

    later = e2e.touch.apply_async(("ahead-eta",), countdown=4)
    row = wait_state(runs, later.id, "completed", timeout=60)
    [run] = key_runs(runs, "ahead-eta")
    assert run["at"] >= row["run_at"], "delivered before run_at by the database clock"
    seen = eta_seen.apply_async(("ahead-seen",), countdown=2)
    assert seen_eta(runs, "ahead-seen") == sent_eta(runs, seen.id)  # exactly the producer's

    seconds = 3 * SHORT_LEASE["lease_timeout"]
    long = hold.apply_async(("ahead-long", seconds), task_id="ahead-long")
    first = wait_for(lambda: key_runs(runs, "ahead-long"), 30, message="the long task")[0]
    assert first["pid"] in ahead.child_pids()
    done = wait_state(runs, long.id, "completed", timeout=60)
    starts = key_runs(runs, "ahead-long")
    assert len(starts) == 1 and done["attempts"] == 1, "a living worker's job was rescued"
    assert "declared lost" not in ahead.log() + helper.log()
    print(f"\n[figure] worker clock +1h: countdown job ran "
          f"{(run['at'] - row['run_at']).total_seconds() * 1000:.0f} ms after its run_at "
          f"(database clock); a {seconds}s task with a "
          f"{SHORT_LEASE['lease_timeout']}s lease ran once (pid {starts[0]['pid']})")


def test_a_worker_an_hour_behind_runs_a_due_job_when_the_database_says(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    behind = skewed_worker(broker_url, "-1h", "-c", "2")
    assert _worker_clock_offset(behind) < -3000, "libfaketime did not skew the worker's clock"

    later = e2e.touch.apply_async(("behind-eta",), countdown=3)
    now = e2e.touch.delay("behind-now")
    wait_state(runs, now.id, "completed", timeout=60)  # an undelayed job runs at once
    # due by the database clock: claimed and run (so fast that "running" may never be seen)
    row = wait_for(lambda: (r := job(runs, later.id))["state"] in ("running", "completed") and r,
                   30, message="the due job to be claimed by the worker whose clock is behind")
    assert row["run_at"] <= row["db_now"]
    wait_for(lambda: key_runs(runs, "behind-eta"), 8, interval=0.2,
             message="the due job to run on the worker whose clock is behind")
    # the task saw an eta of its worker's clock (an hour before the producer's): had it seen
    # the producer's, Celery would have held it for an hour
    seen = eta_seen.apply_async(("behind-seen",), countdown=2)
    assert (sent_eta(runs, seen.id) - seen_eta(runs, "behind-seen")).total_seconds() > 3000
