"""Celery's ``worker_disable_prefetch`` honoured on pgbroker (pgbroker/_celery/prefetch.py): a real
``celery worker`` claims jobs only for its free pool processes, and leaves the rest in the queue
for another worker, where Celery alone (Redis-only) would ignore the setting and prefetch
``worker_prefetch_multiplier`` x processes.

The tasks acknowledge on receipt (Celery's default) with prefetch x4: the configuration where
prefetching differs from a free process most (acks late with prefetch x1 gives the same already).
``hold`` runs until the test records its ``:go`` run, so no test waits a judged time; the poll
is 60 s, so a claim within the test's waits came from the freed process, not from the poll.
"""

from __future__ import annotations

import json

import psycopg
from celery import Celery

from tests.apps import e2e_app as e2e
from tests.support.workers import jobs_by_state, owner_of
from tests.support.processes import WorkerProcess, run_worker, wait_for

CONF = {"task_acks_late": False, "worker_prefetch_multiplier": 4, "worker_disable_prefetch": True}
OPTIONS = {"poll_interval": 60}


def _worker(broker_url: str, processes: int) -> WorkerProcess:
    return run_worker("tests.e2e.shutdown_app", broker_url, "-c", str(processes),
                      env={"PGBROKER_TEST_CELERY_CONF": json.dumps(CONF),
                           "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(OPTIONS)}
                      ).wait_ready(60)


def _started(runs: psycopg.Connection) -> dict[str, int]:
    """The ``hold`` runs started so far: key -> pid."""
    return dict(runs.execute("SELECT key, pid FROM public.runs WHERE task = 'hold' "
                             "AND key NOT LIKE '%:%'").fetchall())


def _wait_states(runs: psycopg.Connection, **states: int) -> None:
    """Wait until the jobs are in these states (an ack on receipt is written at the end of the
    worker's event-loop turn, maybe after the task recorded its run)."""
    wait_for(lambda: jobs_by_state(runs) == states, 10,
             message=lambda: f"jobs {states} (they are {jobs_by_state(runs)})")


def _release(runs: psycopg.Connection, key: str) -> None:
    runs.execute("INSERT INTO public.runs (task, key, pid) VALUES ('test', %s, 0)", (key + ":go",))


def test_a_worker_claims_only_for_its_free_processes(producer: Celery, runs: psycopg.Connection,
                                                     broker_url: str) -> None:
    a = _worker(broker_url, 2)
    keys = [f"held{n}" for n in range(6)]
    for key in keys:
        e2e.hold.apply_async((key,))

    # A claimed two jobs, one per process: the other four wait in the queue (acked on receipt,
    # the two running are completed rows already)
    wait_for(lambda: len(_started(runs)) == 2, 60, message="two holds to start")
    _wait_states(runs, completed=2, pending=4)
    assert "pgbroker: worker_disable_prefetch: claims only for free pool processes (2)" in a.log()
    assert "only supported for Redis" not in a.log()  # Celery's warning that it ignores it

    # one ends: its process claims one job at once (the poll is a minute away)
    first = sorted(_started(runs))[0]
    _release(runs, first)
    wait_for(lambda: len(_started(runs)) == 3, 30,
             message=lambda: f"the freed process to claim a job ({jobs_by_state(runs)})")
    _wait_states(runs, completed=3, pending=3)

    # a second worker runs the three A left in the queue, while A's two still run
    b = _worker(broker_url, 4)
    wait_for(lambda: len(_started(runs)) == 6, 60,
             message=lambda: f"the second worker to run the rest ({jobs_by_state(runs)})")
    started = _started(runs)
    owners = {key: owner_of(pid, a, b) for key, pid in started.items()}
    assert list(owners.values()).count(a) == 3 and list(owners.values()).count(b) == 3

    for key in keys:
        _release(runs, key)
    wait_for(lambda: runs.execute("SELECT count(*) FROM public.runs WHERE key LIKE 'held%:done'"
                                  ).fetchone()[0] == 6, 60, message="every hold to end")
    assert runs.execute("SELECT count(*) FROM public.runs WHERE task = 'hold' "
                        "AND key NOT LIKE '%:%'").fetchone()[0] == 6  # each ran once
