"""End to end: the pgbroker result backend with real ``celery worker`` processes.

The producer is an app of its own per test (``results_app.make_app``) on the test's database;
the worker runs ``tests.apps.results_app``. Chord bodies record their runs in ``public.runs``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery, chord, group

from tests.apps import e2e_app as e2e
from tests.apps import results_app
from tests.support.processes import WorkerProcess, run_worker, wait_for

NAME = "tests.apps.results_app."


@pytest.fixture
def client(broker_url: str, pg: psycopg.Connection) -> Iterator[Celery]:
    """The producer; its waiters rely on NOTIFY alone (see ``results_app.producer``)."""
    pg.execute(e2e.RUNS_DDL)
    with results_app.producer(broker_url) as app:
        yield app


@pytest.fixture
def worker(broker_url: str) -> WorkerProcess:
    return run_worker("tests.apps.results_app", broker_url, "-c", "2").wait_ready(60)


def chord_unlocks(pg: psycopg.Connection) -> int:
    return pg.execute("SELECT count(*) FROM pgbroker.jobs "
                      "WHERE task = 'celery.chord_unlock'").fetchone()[0]


def test_add_delay_get(client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    add = client.tasks[NAME + "add"]
    started = time.monotonic()
    assert add.delay(2, 2).get(timeout=10) == 4
    # the waiter's safety re-read is an hour away: only the NOTIFY can have woken it
    print(f"\n[figure] add.delay(2, 2).get() on an idle worker: "
          f"{(time.monotonic() - started) * 1000:.0f} ms")
    # the result is in its own table, not in the jobs row
    assert pg.execute("SELECT status, result FROM pgbroker.results").fetchall() == [
        ("SUCCESS", 4)]


def test_failure_raises_the_task_exception_with_traceback(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    res = client.tasks[NAME + "fail"].delay("it broke")
    with pytest.raises(results_app.Boom, match="it broke"):
        res.get(timeout=10)
    assert res.state == "FAILURE"
    assert "raise Boom(message)" in res.traceback
    assert 'results_app.py", line' in res.traceback
    row = pg.execute("SELECT status, result->>'exc_type', traceback FROM pgbroker.results "
                     "WHERE task_id = %s", (res.id,)).fetchone()
    assert row[0:2] == ("FAILURE", "Boom")
    assert row[2] == res.traceback


def test_result_extended_fields_are_stored(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    res = client.tasks[NAME + "add"].apply_async((3, 4), queue="celery")
    assert res.get(timeout=10) == 7
    row = pg.execute(
        "SELECT name, args, kwargs, worker, retries, queue, date_done IS NOT NULL "
        "FROM pgbroker.results WHERE task_id = %s", (res.id,)).fetchone()
    assert row == (NAME + "add", [3, 4], {}, row[3], 0, "celery", True)
    # the worker's node name (tests.support.processes: w<pid>-...@host)
    assert row[3].startswith("w")
    # and Celery reads them back
    assert (res.name, res.args, res.kwargs, res.queue) == (NAME + "add", [3, 4], {}, "celery")


def test_group_of_100(client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    add = client.tasks[NAME + "add"]
    started = time.monotonic()
    result = group(add.s(i, i) for i in range(100)).apply_async()
    assert result.get(timeout=120) == [2 * i for i in range(100)]
    print(f"\n[figure] group of 100 add tasks, -c 2: {time.monotonic() - started:.2f} s")
    assert pg.execute("SELECT count(*) FROM pgbroker.results "
                      "WHERE status = 'SUCCESS'").fetchone()[0] == 100
    assert chord_unlocks(pg) == 0


def test_chord_of_100_fires_once_without_chord_unlock(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    add, collect = client.tasks[NAME + "add"], client.tasks[NAME + "collect"]
    started = time.monotonic()
    result = chord(add.s(i, 1) for i in range(100))(collect.s())
    assert result.get(timeout=120) == [i + 1 for i in range(100)]
    print(f"\n[figure] chord of 100 add tasks + callback, -c 2: "
          f"{time.monotonic() - started:.2f} s")
    # the callback's result is stored before its job is acked: wait for the ack, then a
    # little longer would prove nothing more; the counter row says no second claim happened
    wait_for(lambda: pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE state <> 'completed'"
                                ).fetchone()[0] == 0, 30, message="every job completed")
    assert pg.execute("SELECT count(*) FROM public.runs WHERE task = 'collect'"
                      ).fetchone()[0] == 1
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs "
                      "WHERE task = %s", (NAME + "collect",)).fetchone()[0] == 1
    assert chord_unlocks(pg) == 0
    done, size, dispatched = pg.execute(
        "SELECT done, size, dispatched_at IS NOT NULL FROM pgbroker.result_chords").fetchone()
    assert (done, size, dispatched) == (100, 100, True)


def test_chord_with_a_failing_header_task_fails_its_callback(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    add, fail = client.tasks[NAME + "add"], client.tasks[NAME + "fail"]
    collect = client.tasks[NAME + "collect"]
    result = chord([add.s(1, 1), fail.s("header broke"), add.s(2, 2)])(collect.s())
    # get() raises the header's error as soon as the header failed (Celery checks the parents)
    with pytest.raises(results_app.Boom, match="header broke"):
        result.get(timeout=30)
    # and the callback itself is marked failed by the chord, not left pending forever
    body = client.AsyncResult(result.id)
    wait_for(lambda: body.state == "FAILURE", 30, interval=0.1, message="the body's FAILURE")
    assert "header broke" in str(body.result)
    assert pg.execute("SELECT count(*) FROM public.runs WHERE task = 'collect'"
                      ).fetchone()[0] == 0
    assert chord_unlocks(pg) == 0


def test_a_task_replaced_by_itself_runs_every_replacement(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    # each replacement has the task id and the retries of the task it replaces
    result = client.tasks[NAME + "nest"].delay(3)
    assert result.get(timeout=30) == [0, 1, 2, 3]
    assert pg.execute("SELECT count(*), count(DISTINCT task_id) FROM pgbroker.jobs").fetchone() \
        == (4, 1)


def test_a_chord_body_replaced_by_a_group_completes_the_chord(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    add, fan = client.tasks[NAME + "add"], client.tasks[NAME + "fan"]
    result = chord([add.s(1, 1), add.s(2, 2)])(fan.s())
    # the group's results, gathered by celery.accumulate under the body's task id
    assert result.get(timeout=30) == [3, 5]
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_id = %s",
                      (result.id,)).fetchone()[0] == 2  # the body and its accumulate


def test_the_task_sees_the_headers_eta_and_expires_the_producer_sent(
        client: Celery, worker: WorkerProcess, pg: psycopg.Connection) -> None:
    view = client.tasks[NAME + "request_view"]
    plain = view.apply_async(headers={"k1": "v1", "nested": {"a": [1]}})
    assert plain.get(timeout=30) == {"headers": {"k1": "v1", "nested": {"a": [1]}},
                                     "eta": None, "expires": None}
    later = view.apply_async(countdown=1, expires=600)
    sent = pg.execute("SELECT headers->>'eta', headers->>'expires' FROM pgbroker.jobs "
                      "WHERE task_id = %s", (later.id,)).fetchone()
    seen = later.get(timeout=30)
    assert (seen["eta"], seen["expires"]) == sent and None not in sent
    # and the failure hook still finds the delivery's row (its tag is in the properties)
    failed = client.tasks[NAME + "fail"].delay("still dead")
    with pytest.raises(results_app.Boom):
        failed.get(timeout=30)
    wait_for(lambda: pg.execute("SELECT state, last_error FROM pgbroker.jobs WHERE task_id = %s",
                                (failed.id,)).fetchone() == ("dead", "Boom: still dead"),
             30, message="the failed task's dead row with its error")
