"""Every kind of Celery re-publish is a new message, kept; only a producer's own retry of one
publish is dropped as a duplicate, and visibly (a DEBUG line naming the job, a counter).

Celery's own code publishes here (``Task.retry``, ``Task.replace``, ``chord_unlock``'s retry,
canvas with explicit ids), from inside a request pushed as a worker would run it; the rows are
counted with SQL. The producer's retry is kombu's own ``ensure`` re-running ``_publish`` after
the INSERT committed and the connection died before the producer heard back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery, chain, group
from celery.exceptions import Ignore
from prometheus_client import generate_latest

import pgbroker
from pgbroker._pg.store import Store
from pgbroker.errors import DatabaseUnavailable
from pgbroker.metrics import MetricsReader, prometheus_registry
from pgbroker.settings import Settings
from pgbroker.sweeper import Sweeper


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = Celery("republish_tests", broker=broker_url, set_as_current=False)

    @app.task(name="t.step", bind=True, shared=False)
    def step(self: Any, n: int) -> int:
        return n

    try:
        yield app
    finally:
        app.close()


def rows(pg: psycopg.Connection, task_id: str) -> list[tuple[Any, ...]]:
    """(retries, replaced_task_nesting, args) of the jobs of ``task_id``, oldest first."""
    return pg.execute(
        "SELECT retries, (headers->>'replaced_task_nesting')::int, headers->>'argsrepr'"
        " FROM pgbroker.jobs WHERE task_id = %s ORDER BY id", (task_id,)).fetchall()


def deduplicated(pg: psycopg.Connection) -> dict[str, int]:
    """The persistent counter of deduplicated publishes, per queue."""
    snapshot = MetricsReader().snapshot(pg)
    return {q.queue: q.deduplicated for q in snapshot.queues() if q.deduplicated}


def running(task: Any, task_id: str, **request: Any) -> Any:
    """``task`` as a worker runs it: a pushed request (not called directly)."""
    task.push_request(id=task_id, root_id=task_id, called_directly=False, is_eager=False,
                      retries=0, delivery_info={"routing_key": "celery"}, **request)
    return task


def test_retry_and_replace_each_publish_a_new_message(app: Celery,
                                                      pg: psycopg.Connection) -> None:
    step = app.tasks["t.step"]
    step.apply_async((1,), task_id="r")
    running(step, "r")
    try:
        step.retry(args=(1,), countdown=30, throw=False)          # retries 1
        for n in (2, 3):  # replaced by itself twice: same id, retries 0, nesting 1 then 2
            with pytest.raises(Ignore):
                step.replace(step.si(n))
            step.pop_request()
            running(step, "r", replaced_task_nesting=n - 1)
    finally:
        step.pop_request()
    assert rows(pg, "r") == [(0, 0, "(1,)"), (1, 0, "(1,)"), (0, 1, "(2,)"), (0, 2, "(3,)")]
    assert deduplicated(pg) == {}


def test_chord_unlock_retries_and_canvas_members_with_explicit_ids_are_kept(
        app: Celery, pg: psycopg.Connection) -> None:
    unlock = app.tasks["celery.chord_unlock"]
    header = ("g", {"task": "t.step"})
    unlock.apply_async(header, task_id="u", countdown=1)
    running(unlock, "u", args=list(header), kwargs={})
    try:  # what chord_unlock does while the header is not ready
        unlock.retry(countdown=1, max_retries=None, throw=False)
        unlock.request.retries = 1
        unlock.retry(countdown=1, max_retries=None, throw=False)
    finally:
        unlock.pop_request()
    assert [r[0] for r in rows(pg, "u")] == [0, 1, 2]

    step = app.tasks["t.step"]
    # two group members, and a chain's first task, given the same explicit id
    group(step.si(1).set(task_id="x"), step.si(2).set(task_id="x")).apply_async()
    chain(step.si(3).set(task_id="x"), step.si(4)).apply_async()
    assert sorted(r[2] for r in rows(pg, "x")) == ["(1,)", "(2,)", "(3,)"]
    assert deduplicated(pg) == {}


def test_a_producer_retry_of_one_publish_is_one_job_and_says_so(
        app: Celery, pg: psycopg.Connection, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # kombu gives every _publish a new delivery_tag: the retry is recognised by its content
    inserted = []
    real_insert = Store.insert

    def insert_then_lose_the_connection(self: Store, job: Any) -> None:
        real_insert(self, job)  # committed
        inserted.append(job)
        if len(inserted) == 1:  # ... and the connection dies before the answer arrives
            self.conn.close()
            raise DatabaseUnavailable("server closed the connection unexpectedly")

    monkeypatch.setattr(Store, "insert", insert_then_lose_the_connection)
    caplog.set_level(logging.DEBUG, logger="pgbroker")
    result = app.tasks["t.step"].apply_async(
        (7,), retry=True, retry_policy={"max_retries": 3, "interval_start": 0})
    assert len(inserted) == 2, "kombu's ensure did not publish again"
    assert inserted[0].properties == inserted[1].properties  # no delivery_tag: dropped
    [(job_id,)] = pg.execute("SELECT id FROM pgbroker.jobs WHERE task_id = %s",
                             (result.id,)).fetchall()
    assert deduplicated(pg) == {"celery": 1}
    assert [r.getMessage() for r in caplog.records if "deduplicated" in r.getMessage()] == [
        f"pgbroker: publish of task 't.step' ({result.id}) to queue 'celery' deduplicated: "
        f"the same message is job {job_id}"]


def test_an_idempotent_duplicate_is_counted_and_logged(
        app: Celery, pg: psycopg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pgbroker")
    step = app.tasks["t.step"]
    first = step.apply_async((1,), headers={"idempotency_key": "once"})
    step.apply_async((1,), headers={"idempotency_key": "once"})  # another task id, same key
    with psycopg.connect(pg.info.dsn) as conn:  # the enqueue path: the same rule
        existing = pgbroker.enqueue(conn, step, (1,), idempotency_key="once")
    [(job_id,)] = pg.execute("SELECT id FROM pgbroker.jobs").fetchall()
    assert existing == job_id
    assert rows(pg, first.id) == [(0, 0, "(1,)")]
    assert deduplicated(pg) == {"celery": 2}
    assert sum(f"is job {job_id}" in r.getMessage() for r in caplog.records) == 2


def test_the_enqueue_path_keeps_re_publishes_and_drops_the_same_message(
        app: Celery, db_url: str, pg: psycopg.Connection) -> None:
    step = app.tasks["t.step"]
    with psycopg.connect(db_url) as conn:
        with pgbroker.transaction(conn):
            step.apply_async((1,), task_id="t")
            running(step, "t")
            try:
                with pytest.raises(Ignore):
                    step.replace(step.si(2))
            finally:
                step.pop_request()
        with pgbroker.transaction(conn):  # the same message again (a caller's retry)
            step.apply_async((1,), task_id="t")
    assert rows(pg, "t") == [(0, 0, "(1,)"), (0, 1, "(2,)")]
    assert deduplicated(pg) == {"celery": 1}


def test_the_sweeper_folds_the_counter_rows_and_keeps_the_totals(
        app: Celery, db_url: str, pg: psycopg.Connection) -> None:
    step = app.tasks["t.step"]
    for queue in ("a", "b", "a", "a", "a", "b"):  # each published once, then duplicated
        step.apply_async((1,), task_id=f"same-{queue}", queue=queue)
    assert pg.execute("SELECT count(*) FROM pgbroker.publish_duplicates").fetchone()[0] == 4
    store = Store(db_url, Settings())
    try:
        assert Sweeper(store).run_once().folded == 3  # a's three rows; b has one already
        assert Sweeper(store).run_once().folded == 0
    finally:
        store.close()
    assert pg.execute("SELECT queue, duplicates FROM pgbroker.publish_duplicates ORDER BY queue"
                      ).fetchall() == [("a", 3), ("b", 1)]
    assert deduplicated(pg) == {"a": 3, "b": 1}
    text = generate_latest(prometheus_registry(lambda: MetricsReader().snapshot(pg))).decode()
    assert 'pgbroker_publish_duplicates_total{queue="a"} 3.0' in text
    assert 'pgbroker_publish_duplicates_total{queue="b"} 1.0' in text


def test_the_same_message_to_a_fanout_exchange_is_one_job_per_queue(
        app: Celery, pg: psycopg.Connection) -> None:
    exchange = kombu.Exchange("fan_r", type="fanout")
    with app.connection_for_write() as conn:
        for name in ("fr1", "fr2"):
            kombu.Queue(name, exchange)(conn.default_channel).declare()
    step = app.tasks["t.step"]
    for _ in range(2):
        step.apply_async((1,), task_id="f", exchange="fan_r", routing_key="x")
    assert sorted(r[0] for r in pg.execute("SELECT queue FROM pgbroker.jobs")) == ["fr1", "fr2"]
    assert deduplicated(pg) == {"fr1": 1, "fr2": 1}
