"""Dedupe while queued (issue 22, point 1) against a real PostgreSQL.

``dedupe_key`` keeps at most one copy of a (task, key) queued; with ``dedupe_active`` none
while one runs either. The claims, acks and requeues here are the real statements
(``Store.claim`` / ``ack`` / ``requeue``), run as a consumer would; the worker-level behaviour
(Celery retries, a real worker running the copy) is in tests/e2e/test_job_keys_worker.py.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import uuid6
from celery import Celery

import pgbroker
from pgbroker._model.job import NewJob, lookup_params
from pgbroker._pg.catalogue import queries
from pgbroker._pg.store import Store
from pgbroker.errors import MessageError
from tests.support.transport import jobs


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = Celery("dedupe_tests", broker=broker_url, set_as_current=False)

    @app.task(name="t.sync", shared=False)
    def sync(source: int) -> int:
        return source

    @app.task(name="t.other", shared=False)
    def other(source: int) -> int:
        return source

    try:
        yield app
    finally:
        app.close()


def claim_all(store: Store) -> list[Any]:
    return store.claim("celery", 100, uuid.uuid4())


def queued(pg: psycopg.Connection) -> list[dict[str, Any]]:
    return jobs(pg, "state IN ('pending', 'scheduled')")


def test_a_duplicate_returns_the_queued_copy_and_leaves_the_transaction_usable(
        app: Celery, db_url: str, pg: psycopg.Connection) -> None:
    with psycopg.connect(db_url) as conn:
        first = pgbroker.enqueue(conn, "t.sync", (7,), app=app, dedupe_key="sync:source-7")
        again = pgbroker.enqueue(conn, "t.sync", (8,), app=app, dedupe_key="sync:source-7")
        assert again == first
        # per task: the same key of another task is another slot
        other = pgbroker.enqueue(conn, "t.other", (7,), app=app, dedupe_key="sync:source-7")
        assert other != first
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)  # no aborted transaction
        conn.commit()
        # a later transaction, and the header form
        assert pgbroker.enqueue(conn, "t.sync", (9,), app=app,
                                headers={"dedupe_key": "sync:source-7"}) == first
        conn.commit()
    assert [r["id"] for r in jobs(pg)] == [first, other]
    # the trace of the two duplicates: pgbroker stats' counter
    assert pg.execute("SELECT sum(duplicates) FROM pgbroker.publish_duplicates").fetchone() == (2,)


def test_apply_async_headers_dedupe_through_the_transport(app: Celery, pg: psycopg.Connection
                                                           ) -> None:
    sync = app.tasks["t.sync"]
    for n in range(5):
        sync.apply_async((n,), headers={"dedupe_key": "k"})
    sync.apply_async((99,), headers={"dedupe_key": "other"})
    rows = queued(pg)
    assert [(r["dedupe_key"], r["dedupe_active"]) for r in rows] == [("k", False),
                                                                    ("other", False)]


def test_a_new_copy_is_accepted_once_the_queued_one_has_started(
        app: Celery, db_url: str, pg: psycopg.Connection, store: Store) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = pgbroker.enqueue(conn, "t.sync", (1,), app=app, dedupe_key="s")
        [claimed] = claim_all(store)
        assert claimed.id == first
        # running, not queued: a second copy is accepted ...
        second = pgbroker.enqueue(conn, "t.sync", (2,), app=app, dedupe_key="s")
        assert second != first
        # ... and a third is a duplicate of the second, not of the running first
        assert pgbroker.enqueue(conn, "t.sync", (3,), app=app, dedupe_key="s") == second
        # the first one put back (its worker lost, or requeued) never conflicts with the
        # second: it is queued again without the slot
        assert store.requeue([(first, 1)]) == 1
        assert {r["id"]: r["state"] for r in jobs(pg)} == {first: "pending", second: "pending"}
        assert pgbroker.enqueue(conn, "t.sync", (4,), app=app, dedupe_key="s") == second


def test_dedupe_active_refuses_a_copy_while_one_runs(
        app: Celery, db_url: str, pg: psycopg.Connection, store: Store) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = pgbroker.enqueue(conn, "t.sync", (1,), app=app, dedupe_key="s",
                                 dedupe_active=True)
        [claimed] = claim_all(store)
        # a sync already under way makes a second request pointless
        assert pgbroker.enqueue(conn, "t.sync", (2,), app=app, dedupe_key="s",
                                dedupe_active=True) == first
        # put back (requeued), it keeps its slot
        assert store.requeue([(first, 1)]) == 1
        assert pgbroker.enqueue(conn, "t.sync", (3,), app=app, dedupe_key="s",
                                dedupe_active=True) == first
        [claimed] = claim_all(store)
        assert store.ack([(claimed.id, claimed.attempt)]) == 1
        # finished: a new one is accepted
        third = pgbroker.enqueue(conn, "t.sync", (4,), app=app, dedupe_key="s",
                                 dedupe_active=True)
        assert third != first
    assert [(r["id"], r["state"]) for r in jobs(pg)] == [(first, "completed"), (third, "pending")]


def test_a_duplicate_whose_copy_started_meanwhile_names_that_copy(
        app: Celery, db_url: str, store: Store) -> None:
    """The insert met the queued copy; the copy was claimed before the look-up
    (job_enqueued_ids): the publish is still reported as a duplicate of that copy (the newest
    row with the key), not as an error."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = pgbroker.enqueue(conn, "t.sync", (1,), app=app, dedupe_key="s")
        claim_all(store)
        skipped = NewJob(id=uuid.uuid4(), queue="celery", body=b"", content_type=None,
                         content_encoding=None, headers={"dedupe_key": "s"}, properties={},
                         task="t.sync", task_id=str(uuid.uuid4()))
        rows = conn.execute(queries("pgbroker")["job_enqueued_ids"],
                            lookup_params([skipped])).fetchall()
    assert rows == [(first, "dedupe")]


def test_eight_threads_at_once_leave_one_queued_job(app: Celery, db_url: str,
                                                    pg: psycopg.Connection) -> None:
    barrier = threading.Barrier(8)
    ids: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def enqueue(n: int) -> None:
        try:
            with psycopg.connect(db_url) as conn:
                barrier.wait(10)
                job_id = pgbroker.enqueue(conn, "t.sync", (n,), app=app, dedupe_key="race")
                assert conn.execute("SELECT 1").fetchone() == (1,)
                conn.commit()
                ids.append(job_id)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    for _round in range(5):
        pg.execute("DELETE FROM pgbroker.jobs")
        ids.clear()
        threads = [threading.Thread(target=enqueue, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        rows = queued(pg)
        assert len(rows) == 1
        assert ids == [rows[0]["id"]] * 8


@pytest.mark.parametrize("headers, error", [
    ({"dedupe_key": "x" * 1025}, "dedupe_key is 1025 bytes in UTF-8; the limit is 1024"),
    ({"dedupe_key": ""}, "dedupe_key must be a non-empty string"),
    ({"dedupe_key": 5}, "dedupe_key must be a non-empty string"),
    ({"dedupe_key": "a\x00b"}, "contains a NUL"),
    ({"dedupe_key": "k", "dedupe_active": "yes"}, "dedupe_active must be true or false"),
    ({"dedupe_active": True}, "dedupe_active=True needs a dedupe_key"),
    ({"concurrency_key": "c" * 1025}, "concurrency_key is 1025 bytes"),
    ({"concurrency_key": "c", "concurrency_limit": -1}, "concurrency_limit must be a positive"),
    ({"concurrency_key": "c", "concurrency_limit": 0}, "concurrency_limit must be a positive"),
    ({"concurrency_key": "c", "concurrency_limit": True}, "concurrency_limit must be a positive"),
    ({"concurrency_limit": 2}, "concurrency_limit needs a concurrency_key"),
])
def test_bad_keys_are_refused_at_publish_and_nothing_is_written(
        app: Celery, db_url: str, pg: psycopg.Connection, headers: dict[str, Any],
        error: str) -> None:
    with psycopg.connect(db_url) as conn:
        with pytest.raises(MessageError, match=error.replace("(", r"\(")):
            pgbroker.enqueue(conn, "t.sync", (1,), app=app, headers=headers)
        with pytest.raises(MessageError, match=error.replace("(", r"\(")):
            pgbroker.enqueue(conn, "t.sync", (1,), app=app, **headers)
        assert conn.execute("SELECT 1").fetchone() == (1,)
    with pytest.raises(MessageError, match=error.replace("(", r"\(")):
        app.tasks["t.sync"].apply_async((1,), headers=headers)
    assert jobs(pg) == []


def test_a_retry_written_in_a_batch_takes_the_slot_over_as_a_single_insert_does(
        app: Celery, db_url: str, pg: psycopg.Connection, store: Store) -> None:
    """A Celery retry (the same task id, retries + 1) published inside pgbroker.transaction()
    goes out in job_insert_many's batch; it takes its running copy's slot over, as job_insert's
    does (the trigger jobs_dedupe_handover does it for every insert), rather than being dropped
    as a duplicate of the copy it continues."""
    sync = app.tasks["t.sync"]
    headers = {"dedupe_key": "s", "dedupe_active": True}
    with psycopg.connect(db_url) as conn:
        first = sync.apply_async((1,), headers=headers)
        [claimed] = claim_all(store)  # running, holding the slot
        with pgbroker.transaction(conn):
            sync.apply_async((1,), headers=headers, task_id=first.id, retries=1, countdown=60)
            sync.apply_async((2,), headers=headers)  # a new request: a duplicate of the retry
        conn.commit()
    rows = {(r["task_id"], r["retries"]): (r["state"], r["dedupe_key"]) for r in jobs(pg)}
    assert rows == {(first.id, 0): ("running", None), (first.id, 1): ("scheduled", "s")}


def test_a_retry_published_twice_keeps_the_slot(app: Celery, db_url: str, pg: psycopg.Connection,
                                                store: Store) -> None:
    """A producer's own re-publish of a retry (kombu's ensure running the publish again: the
    same message) is a duplicate of it; it takes nothing from it, since only a copy with fewer
    retries gives its key up. Before, the re-publish cleared the retry's key and was then
    dropped: nobody held the slot, and a new request was queued beside the retry."""
    headers = {"dedupe_key": "s", "dedupe_active": True}
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = pgbroker.enqueue(conn, "t.sync", (1,), app=app, **headers)
        [claimed] = claim_all(store)
        [task_id] = pg.execute("SELECT task_id FROM pgbroker.jobs").fetchone()
        retry = NewJob(id=uuid6.uuid7(), queue="celery", body=b"[[1], {}, {}]",
                       content_type="application/json", content_encoding="utf-8",
                       headers={"task": "t.sync", "id": task_id, "retries": 1, **headers},
                       properties={}, task="t.sync", task_id=task_id, retries=1)
        store.insert(retry)
        store.insert(dataclasses.replace(retry, id=uuid6.uuid7()))  # the same message again
        assert pgbroker.enqueue(conn, "t.sync", (2,), app=app, **headers) == retry.id
    assert [(r["id"], r["dedupe_key"]) for r in jobs(pg)] == [(first, None), (retry.id, "s")]
