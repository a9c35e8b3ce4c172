"""Chaos: real ``celery worker`` processes killed, frozen and stopped while they hold jobs.

Every task of ``tests.apps.e2e_app`` records its runs in ``public.runs``; ``nap`` records ``<key>``
when it starts and ``<key>:done`` when it finishes, so a lost task (no ``:done``) and a duplicate
(two starts) are both visible in SQL. Recovery times are printed (``pytest -s``), not asserted;
the only time bound checked is the one that tells which rescue mechanism fired, on the database
clock.
"""

from __future__ import annotations

import os
import re
import signal
from datetime import timedelta

import psycopg
from celery import Celery

from pgbroker.settings import Settings
from tests.apps import e2e_app as e2e
from tests.support.workers import (
    SHORT_LEASE,
    job,
    jobs_by_state,
    key_runs,
    owner_of,
    start_worker,
    wait_done,
    wait_state,
)
from tests.support.producers import point_producer
from tests.support.db import db_now
from tests.support.processes import wait_for


def _all_completed(pg: psycopg.Connection, count: int) -> None:
    """Wait for every job to be completed (a ``:done`` run is recorded just before the ack)."""
    wait_for(lambda: jobs_by_state(pg) == {"completed": count}, 30, interval=0.05,
             message=lambda: f"all {count} jobs completed ({jobs_by_state(pg)})")


def _publish_naps(prefix: str, count: int, seconds: float) -> list[str]:
    """Publish ``count`` naps whose key is also their task id (so jobs and runs join)."""
    keys = [f"{prefix}-{i:03}" for i in range(count)]
    for key in keys:
        e2e.nap.apply_async((key, seconds), task_id=key)
    return keys


def _started(pg: psycopg.Connection) -> int:
    """How many task runs have started so far."""
    return pg.execute("SELECT count(*) FROM public.runs").fetchone()[0]


def test_sigkilled_pool_child_task_runs_again_and_completes(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    worker = start_worker(broker_url)
    result = e2e.nap.delay("victim", 3)
    first = wait_for(lambda: key_runs(runs, "victim"), 30, message="the first run")[0]
    assert first["pid"] in worker.child_pids()

    os.kill(first["pid"], signal.SIGKILL)

    row = wait_state(runs, result.id, "completed")
    starts = key_runs(runs, "victim")
    assert [r["redelivered"] for r in starts] == [False, True]
    assert starts[1]["pid"] != first["pid"]
    assert len(key_runs(runs, "victim:done")) == 1
    assert row["attempts"] == 2
    assert "WorkerLostError" in worker.log()
    assert worker.is_alive()


def test_sigkilled_worker_second_worker_completes_everything(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    keys = _publish_naps("nap", 200, 0.1)
    doomed = start_worker(broker_url, "-c", "4")
    survivor = start_worker(broker_url, "-c", "4")

    def doomed_busy() -> bool:
        started = _started(runs)
        running = runs.execute(
            "SELECT count(*) FROM pgbroker.jobs AS j JOIN pgbroker.consumers AS c"
            " ON c.id = j.locked_by WHERE j.state = 'running' AND c.pid = %s",
            (doomed.pid,)).fetchone()[0]
        return started >= 60 and running > 0

    wait_for(doomed_busy, 60, interval=0.02, message="the first worker to be mid-batch")
    # the last heartbeat of the dead worker's consumer that holds jobs (it can only get older)
    last_heartbeat = runs.execute(
        "SELECT min(heartbeat_at) FROM pgbroker.consumers AS c WHERE pid = %s AND EXISTS"
        " (SELECT 1 FROM pgbroker.jobs WHERE locked_by = c.id AND state = 'running')",
        (doomed.pid,)).fetchone()[0]
    doomed_pids = {doomed.pid, *doomed.child_pids()}
    doomed.kill_group(signal.SIGKILL)
    killed_at = db_now(runs)
    doomed.wait(10)

    wait_done(runs, keys, 90)
    finished_at = db_now(runs)
    _all_completed(runs, 200)
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 200  # no copies

    rescued = {r[0]: r[1] for r in runs.execute(
        "SELECT task_id, attempts FROM pgbroker.jobs WHERE attempts > 1")}
    starts = runs.execute(
        "SELECT key, array_agg(pid ORDER BY n), array_agg(redelivered ORDER BY n),"
        " min(at) FILTER (WHERE redelivered) FROM public.runs"
        " WHERE key NOT LIKE '%:done' GROUP BY key").fetchall()
    assert {s[0] for s in starts} == set(keys)
    duplicates = [s for s in starts if len(s[1]) > 1]
    for key, pids, redelivered, _ in duplicates:
        # only a job the dead worker held could run twice: first there, then once more here
        assert key in rescued, (key, pids)
        assert pids[0] in doomed_pids and len(pids) == 2 and redelivered == [False, True]
        assert pids[1] in survivor.child_pids()
    # nothing but the dead worker's prefetch window (-c 4, prefetch 1 => 4) was redelivered
    assert 1 <= len(rescued) <= 4, rescued
    assert all(attempts == 2 for attempts in rescued.values())

    reruns = [s[3] for s in starts if s[3] is not None]
    assert reruns, "no task of the dead worker was redelivered"
    first_rerun = min(reruns)
    # The rescue came from the released advisory lock: the heartbeat path (lease_timeout after
    # the last heartbeat) cannot have fired yet when the first rescued job started again.
    assert first_rerun - last_heartbeat < timedelta(seconds=Settings().lease_timeout), \
        (first_rerun, last_heartbeat)
    print(f"\n[figure] worker SIGKILLed with {len(rescued)} job(s) claimed: first rescued job "
          f"started again {(first_rerun - killed_at).total_seconds():.2f}s after the kill, all "
          f"200 done {(finished_at - killed_at).total_seconds():.2f}s after it; "
          f"{len(duplicates)} task(s) ran twice (all in flight at the kill)")


def test_task_longer_than_lease_on_living_worker_runs_once(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    owner = start_worker(broker_url, "-c", "1", options=SHORT_LEASE)
    result = e2e.nap.delay("long", 10)
    start = wait_for(lambda: key_runs(runs, "long"), 30, message="the long task to start")[0]
    assert start["pid"] in owner.child_pids()

    # A second worker sweeping every second while the long task runs far past the 3 s lease.
    other = start_worker(broker_url, options=SHORT_LEASE)
    probe = e2e.touch.delay("probe")  # the owner has no free slot: the other worker runs it
    wait_state(runs, probe.id, "completed")
    assert key_runs(runs, "probe")[0]["pid"] in other.child_pids()

    row = wait_state(runs, result.id, "completed")
    assert len(key_runs(runs, "long")) == 1
    assert len(key_runs(runs, "long:done")) == 1
    assert row["attempts"] == 1
    assert (row["updated_at"] - start["at"]).total_seconds() > 3 * SHORT_LEASE["lease_timeout"]
    assert "declared lost" not in owner.log()
    rescues = re.findall(r"sweeper: [1-9]\d* job\(s\) of lost consumers", owner.log() + other.log())
    assert not rescues


def _poison(pg: psycopg.Connection, task_id: str, key: str, attempts: int) -> dict:
    """Wait for the poison job to be dead; check it ran ``attempts`` times and stays dead."""
    row = wait_state(pg, task_id, "dead")
    assert row["attempts"] == row["max_attempts"] == attempts
    assert len(key_runs(pg, key)) == attempts
    follow_up = e2e.touch.delay(key + "-after")  # the worker still works ...
    wait_state(pg, follow_up.id, "completed")
    assert len(key_runs(pg, key)) == attempts  # ... and the poison did not run again
    assert job(pg, task_id)["state"] == "dead"
    return row


def test_poison_task_goes_dead_after_max_attempts_header(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    worker = start_worker(broker_url)
    result = e2e.suicide.apply_async(("poison",), headers={"max_attempts": 3})
    row = _poison(runs, result.id, "poison", 3)
    assert row["last_error"]
    assert worker.is_alive()


def test_poison_task_goes_dead_after_max_attempts_option(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    options = {"max_attempts": 2}
    point_producer(producer, broker_url, options)  # the default is applied at publish
    worker = start_worker(broker_url, options=options)
    result = e2e.suicide.delay("poison2")
    row = _poison(runs, result.id, "poison2", 2)
    assert row["last_error"]
    assert worker.is_alive()


def test_poison_task_last_error_says_the_worker_was_lost(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    start_worker(broker_url)
    result = e2e.suicide.apply_async(("poison3",), headers={"max_attempts": 2})
    row = wait_state(runs, result.id, "dead")
    assert "lost" in row["last_error"], row["last_error"]


def test_frozen_worker_past_lease_late_ack_changes_nothing(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    first = start_worker(broker_url, options=SHORT_LEASE, ready=False)
    second = start_worker(broker_url, options=SHORT_LEASE, ready=False)
    first.wait_ready(60), second.wait_ready(60)
    result = e2e.nap.delay("frozen", 6)
    start = wait_for(lambda: key_runs(runs, "frozen"), 30, message="the nap to start")[0]
    stale = owner_of(start["pid"], first, second)
    fresh = second if stale is first else first

    stale.kill_group(signal.SIGSTOP)
    try:
        row = wait_state(runs, result.id, "completed")
        starts = key_runs(runs, "frozen")
        assert len(starts) == 2 and starts[1]["redelivered"] is True
        assert starts[1]["pid"] in fresh.child_pids()
        assert row["attempts"] == 2
        fresh.stop()
    finally:
        stale.kill_group(signal.SIGCONT)

    # The stale worker wakes up, finishes its copy and acks the old delivery (attempt 1).
    stale.wait_for_log(f"Task tests.apps.e2e_app.nap[{result.id}] succeeded", 30)
    after = e2e.touch.delay("after-thaw")  # the stale worker is the only one left
    wait_state(runs, after.id, "completed")
    assert key_runs(runs, "after-thaw")[0]["pid"] in stale.child_pids()
    assert len(key_runs(runs, "frozen:done")) == 2  # both copies ran to the end ...
    now = job(runs, result.id)
    for column in ("state", "attempts", "updated_at", "locked_by", "last_error"):
        assert now[column] == row[column], column  # ... but the late ack changed nothing
    assert stale.is_alive()


def test_warm_shutdown_gives_prefetched_messages_back(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    keys = _publish_naps("warm", 8, 1.5)
    worker = start_worker(broker_url, "-c", "1", "--prefetch-multiplier", "4")
    wait_for(lambda: jobs_by_state(runs).get("running") == 4 and _started(runs), 30,
             message=lambda: f"4 claimed jobs, one of them running ({jobs_by_state(runs)})")

    worker.kill(signal.SIGTERM)
    assert worker.wait(30) == 0
    states = jobs_by_state(runs)
    assert "running" not in states, states  # given back at once, not by the sweeper later
    assert sum(states.values()) == 8  # back as the same rows, never copies
    given_back = runs.execute("SELECT task_id, attempts, last_error FROM pgbroker.jobs"
                              " WHERE state = 'pending' AND attempts > 0").fetchall()
    assert len(given_back) == 4 - states.get("completed", 0) >= 1, (states, given_back)

    start_worker(broker_url)
    wait_done(runs, keys, 60)
    _all_completed(runs, 8)
    for key in keys:
        assert len(key_runs(runs, key)) == 1, key  # the prefetched ones had not started
    for task_id, _, last_error in given_back:
        assert "restored" in last_error  # by the stopping worker itself, not by a sweeper
        assert key_runs(runs, task_id)[0]["redelivered"] is True
