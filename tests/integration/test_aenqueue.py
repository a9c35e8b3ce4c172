"""Asyncio enqueue (issue 21) against a real PostgreSQL: ``await pgbroker.aenqueue(db, ...)``,
``await pgbroker.aenqueue_many(db, ...)`` and ``async with pgbroker.atransaction(db):``.

Every test that writes runs with the three kinds of asyncio connection pgbroker accepts (the
``kind`` fixture): a SQLAlchemy ``AsyncSession``, a SQLAlchemy ``AsyncConnection`` (both on
psycopg's async driver) and a psycopg ``AsyncConnection``. The guarantees checked are those of
the synchronous forms (tests/integration/test_enqueue.py): the job exists exactly when the
caller's transaction commits, the NOTIFY comes with the commit, an idempotency key makes one job,
bad input is refused with nothing written. What another session sees is read through ``pg``
(synchronous, autocommit). No pytest plugin: each test is a coroutine run by ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Callable
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery, chain, group
from sqlalchemy.ext.asyncio import async_scoped_session, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

import pgbroker
from pgbroker._model.claimed import parse_wake
from pgbroker.errors import IdempotencyKeyRequired, SchemaError
from tests.support.enqueue import (
    ASYNC_KINDS, AsyncRecorder, Recorder, asynchronous, comparable, opened, pgbroker_inserts,
    rows_of)
from tests.integration.test_enqueue import (  # noqa: F401 - app and mixed_app are fixtures
    BAD_CALLS, app, decoded_body, jobs, listener, mixed_app, mixed_items, notifications, things)

#: pgbroker's asyncio forms under the names BAD_CALLS calls (``api.enqueue``, ...).
ASYNC_API = types.SimpleNamespace(enqueue=pgbroker.aenqueue, enqueue_many=pgbroker.aenqueue_many)


@pytest.fixture(params=ASYNC_KINDS)
def kind(request: pytest.FixtureRequest, pg: psycopg.Connection) -> str:
    """A kind of asyncio caller (see :class:`AsyncCaller`); the test's database has a table of
    the application's own, ``public.things``."""
    pg.execute("CREATE TABLE public.things (name text PRIMARY KEY)")
    Recorder.log = []
    return request.param


async def lock_waits(pg: psycopg.Connection, count: int) -> None:
    """Wait (yielding to the event loop) until ``count`` backends of this database wait on a
    lock."""
    for _ in range(300):
        if pg.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                      " AND wait_event_type = 'Lock'").fetchone()[0] == count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {count} backend(s) waiting on a lock after 30 s")


# -- aenqueue: the sync guarantees, awaited ------------------------------------------------------

@asynchronous
async def test_aenqueue_writes_what_enqueue_writes_in_the_callers_transaction(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    async with opened(kind, db_url) as caller:
        await caller.execute("INSERT INTO public.things VALUES ('order-1')")
        job_id = await pgbroker.aenqueue(caller.db, app.tasks["t.add"], (2, 3), queue="orders")
        assert jobs(pg) == [] and things(pg) == []  # nothing visible before the commit
        await caller.commit()
    with psycopg.connect(db_url) as conn:  # the synchronous form, for comparison
        sync_id = pgbroker.enqueue(conn, app.tasks["t.add"], (2, 3), queue="orders")

    row, sync_row = rows_of(pg, [job_id, sync_id])
    assert things(pg) == ["order-1"]
    assert (row["queue"], row["task"], row["state"]) == ("orders", "t.add", "pending")
    assert comparable(row) == comparable(sync_row)
    assert decoded_body(row)[:2] == [[2, 3], {}]


@asynchronous
async def test_a_rollback_leaves_no_job_and_no_notification(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    listen = listener(db_url)
    try:
        async with opened(kind, db_url) as caller:
            await caller.execute("INSERT INTO public.things VALUES ('cancelled')")
            await pgbroker.aenqueue(caller.db, "t.add", (1, 2), app=app)
            await pgbroker.aenqueue_many(caller.db, [("t.add", (i, i)) for i in range(3)],
                                         app=app)
            async with pgbroker.atransaction(caller.db):
                app.tasks["t.add"].delay(5, 5)
            await caller.rollback()
        assert jobs(pg) == [] and things(pg) == []
        assert notifications(listen, 0.3) == []
    finally:
        listen.close()


@asynchronous
async def test_the_wake_up_notification_comes_with_the_commit(
        kind: str, db_url: str, app: Celery) -> None:  # noqa: F811
    listen = listener(db_url)
    try:
        async with opened(kind, db_url) as caller:
            await pgbroker.aenqueue(caller.db, "t.add", (1, 2), app=app, queue="wake")
            assert notifications(listen, 0.5) == []  # the transaction is still open
            await caller.commit()
            [payload] = notifications(listen, 30)
        kind, queue = payload.split(" ")
        delay, place = parse_wake(kind)  # (0014_claim_cursor.sql)
        assert (delay, place[0], queue) == (0, 0, "wake")
    finally:
        listen.close()


@asynchronous
async def test_a_duplicate_key_returns_the_existing_job_without_an_error(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    pay = app.tasks["t.pay"]
    async with opened(kind, db_url) as caller:
        first = await pgbroker.aenqueue(caller.db, pay, (10,), idempotency_key="refund-1")
        assert await pgbroker.aenqueue(caller.db, pay, (99,), idempotency_key="refund-1") == first
        other = await pgbroker.aenqueue(caller.db, "t.add", (1, 2), app=app,
                                        idempotency_key="refund-1")
        assert other != first  # the key is unique per task
        assert await caller.execute("SELECT 41 + 1") == [(42,)]  # the transaction goes on
        await caller.commit()
        # and a duplicate of a committed job, from a later transaction
        assert await pgbroker.aenqueue(caller.db, pay, (7,), idempotency_key="refund-1") == first
        await caller.commit()
    rows = jobs(pg)
    assert [r["id"] for r in rows] == [first, other]
    assert decoded_body(rows[0])[0] == [10]


@asynchronous
async def test_a_required_key_is_refused_and_the_transaction_still_works(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    async with opened(kind, db_url) as caller:
        await caller.execute("INSERT INTO public.things VALUES ('refund-1')")
        with pytest.raises(IdempotencyKeyRequired, match="'t.pay' requires an idempotency key"):
            await pgbroker.aenqueue(caller.db, "t.pay", (10,), app=app)
        with pytest.raises(IdempotencyKeyRequired):
            async with pgbroker.atransaction(caller.db):
                app.tasks["t.pay"].delay(10)
        await caller.execute("INSERT INTO public.things VALUES ('refund-2')")
        await caller.commit()
    assert things(pg) == ["refund-1", "refund-2"]
    assert jobs(pg) == []


@pytest.mark.parametrize("first_commits", [True, False], ids=["commit", "rollback"])
@asynchronous
async def test_a_concurrent_duplicate_waits_without_blocking_the_event_loop(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection, first_commits: bool) -> None:  # noqa: F811
    """The second insert waits on the first transaction's uncommitted key, and the event loop
    runs on meanwhile: the first transaction ends from the same loop (a blocking wait would
    never let it). After a commit the second gets the first job's id, after a rollback its own."""
    async with opened(kind, db_url) as first, opened(kind, db_url) as second:
        first_id = await pgbroker.aenqueue(first.db, "t.pay", (1,), app=app,
                                           idempotency_key="race")
        waiting = asyncio.create_task(pgbroker.aenqueue(second.db, "t.pay", (2,), app=app,
                                                        idempotency_key="race"))
        await lock_waits(pg, 1)
        assert not waiting.done()
        await (first.commit() if first_commits else first.rollback())
        second_id = await asyncio.wait_for(waiting, 30)
        assert (second_id == first_id) is first_commits
        assert await second.execute("SELECT 1") == [(1,)]
        await second.commit()
    assert [r["id"] for r in jobs(pg)] == [second_id]


# -- aenqueue_many -------------------------------------------------------------------------------

@asynchronous
async def test_aenqueue_many_pipelines_its_batches_and_resolves_duplicates(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    async with opened(kind, db_url) as caller:
        existing = await pgbroker.aenqueue(caller.db, "t.pay", (0,), app=app,
                                           idempotency_key="k0")
        items = [("t.pay", (i,), None, {"idempotency_key": f"k{i % 50}"}) for i in range(100)]
        items += [(app.tasks["t.add"], (i, i)) for i in range(2400)]
        Recorder.log = []
        ids = await pgbroker.aenqueue_many(caller.db, items, app=app, batch_size=1000)
        assert jobs(pg) == []
        await caller.commit()
    assert ids[0] == ids[50] == existing  # a duplicate of a job of the same transaction
    assert ids[1:50] == ids[51:100]  # duplicates inside the batch
    assert len(set(ids)) == 50 + 2400 == len(jobs(pg))
    inserts = pgbroker_inserts()
    # one statement per batch of 1000, sent in a pipeline (and the keyed jobs' look-up with them)
    assert len(inserts) == 3 and all(in_pipeline for _, in_pipeline in inserts)


@asynchronous
async def test_aenqueue_many_writes_the_rows_enqueue_many_writes(
        db_url: str, mixed_app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    items = mixed_items(mixed_app)
    async with opened("async_psycopg", db_url) as caller:
        ids = await pgbroker.aenqueue_many(caller.db, items, app=mixed_app, batch_size=100)
        await caller.commit()
    with psycopg.connect(db_url) as conn:
        sync_ids = pgbroker.enqueue_many(conn, items, app=mixed_app, batch_size=100)
    for item, got, expected in zip(items, rows_of(pg, ids), rows_of(pg, sync_ids), strict=True):
        assert comparable(got) == comparable(expected), item


@pytest.mark.parametrize("call, error, match", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
@asynchronous
async def test_bad_input_is_refused_before_anything_is_written(
        db_url: str, app: Celery, pg: psycopg.Connection, call: Callable[[Any, Any, Celery], Any],  # noqa: F811
        error: type[Exception], match: str) -> None:
    pg.execute("CREATE TABLE public.things (name text PRIMARY KEY)")
    async with opened("async_psycopg", db_url) as caller:
        await caller.execute("INSERT INTO public.things VALUES ('kept')")
        with pytest.raises(error, match=match):
            await call(ASYNC_API, caller.db, app)
        await caller.execute("INSERT INTO public.things VALUES ('kept too')")
        await caller.commit()
    assert things(pg) == ["kept", "kept too"] and jobs(pg) == []


@asynchronous
async def test_sync_and_async_connections_are_each_refused_by_the_other_form(
        db_url: str, app: Celery) -> None:  # noqa: F811
    to_sync = "is a synchronous connection: use `pgbroker.enqueue"
    with psycopg.connect(db_url) as sync_conn, Session() as session:
        for db in (sync_conn, session):
            with pytest.raises(TypeError, match=to_sync):
                await pgbroker.aenqueue(db, "t.add", (1, 2), app=app)
            with pytest.raises(TypeError, match=to_sync):
                await pgbroker.aenqueue_many(db, [("t.add", (1, 2))], app=app)
            with pytest.raises(TypeError, match=to_sync):
                async with pgbroker.atransaction(db):
                    pass
    with pytest.raises(TypeError, match="not builtins.object"):
        await pgbroker.aenqueue(object(), "t.add", (1, 2), app=app)
    to_async = "is an asyncio connection: use `await pgbroker.aenqueue"
    for kind in ASYNC_KINDS:
        async with opened(kind, db_url) as caller:
            with pytest.raises(TypeError, match=to_async):
                pgbroker.enqueue(caller.db, "t.add", (1, 2), app=app)
            with pytest.raises(TypeError, match=to_async):
                pgbroker.enqueue_many(caller.db, [("t.add", (1, 2))], app=app)
            with pytest.raises(TypeError, match=to_async), pgbroker.transaction(caller.db):
                pass


@asynchronous
async def test_an_async_scoped_session_is_its_current_session(
        db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    engine = create_async_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    scoped = async_scoped_session(async_sessionmaker(engine), scopefunc=asyncio.current_task)
    try:
        job_id = await pgbroker.aenqueue(scoped, "t.add", (1, 2), app=app)
        async with pgbroker.atransaction(scoped):
            published = app.tasks["t.add"].delay(3, 4)
        assert jobs(pg) == []
        await scoped.commit()
        assert {r["id"] for r in jobs(pg)} >= {job_id}
        assert published.id in {r["task_id"] for r in jobs(pg)}
    finally:
        await scoped.remove()
        await engine.dispose()


@asynchronous
async def test_a_database_without_the_schema_is_a_clear_error(db_url: str,
                                                              broker_url: str) -> None:
    app = Celery("elsewhere", broker=broker_url, set_as_current=False)  # noqa: F811
    app.conf.broker_transport_options = {"schema": "not_migrated"}
    async with opened("async_session", db_url) as caller:
        with pytest.raises(SchemaError, match="no pgbroker schema 'not_migrated'"):
            await pgbroker.aenqueue(caller.db, "t.add", (1, 2), app=app)
        await caller.rollback()  # (the failed statement ended the transaction)
        with pytest.raises(SchemaError, match="no pgbroker schema 'not_migrated'"):
            # three batches: pipelined, so the error comes when the pipeline ends
            await pgbroker.aenqueue_many(caller.db, [("t.add", (1, 2))] * 3, app=app,
                                         batch_size=1)


# -- atransaction --------------------------------------------------------------------------------

@asynchronous
async def test_atransaction_routes_delay_send_task_chain_and_group(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    add = app.tasks["t.add"]
    async with opened(kind, db_url) as caller:
        async with pgbroker.atransaction(caller.db):
            await caller.execute("INSERT INTO public.things VALUES ('basket')")
            single = add.delay(1, 2)
            sent = app.send_task("t.add", (3, 4))
            chained = chain(add.s(1, 1), add.s(10)).apply_async()
            grouped = group(add.s(i, i) for i in range(5)).apply_async()
            assert jobs(pg) == []  # buffered, then written in the caller's transaction
        assert jobs(pg) == []
        await caller.commit()
    rows = jobs(pg)
    assert things(pg) == ["basket"]
    assert {single.id, sent.id, chained.parent.id} | {r.id for r in grouped.results} == {
        r["task_id"] for r in rows}
    assert len(rows) == 8
    assert len(pgbroker_inserts()) == 1  # one statement for the whole block


@asynchronous
async def test_atransaction_rollback_leaves_nothing(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    async with opened(kind, db_url) as caller:
        async with pgbroker.atransaction(caller.db):
            group(app.tasks["t.add"].s(i, i) for i in range(3)).apply_async()
            await caller.execute("INSERT INTO public.things VALUES ('basket')")
        await caller.rollback()
        with pytest.raises(ZeroDivisionError):
            async with pgbroker.atransaction(caller.db):
                app.tasks["t.add"].delay(3, 4)
                1 / 0  # noqa: B018 - the application fails inside the block
        assert len(pgbroker_inserts()) == 2  # written on the way out: the transaction is healthy
        await caller.rollback()
    assert jobs(pg) == [] and things(pg) == []


@asynchronous
async def test_a_failed_transaction_drops_the_block_and_raises_the_callers_error(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    async with opened(kind, db_url) as caller:
        await caller.execute("INSERT INTO public.things VALUES ('taken')")
        with pytest.raises(Exception, match="duplicate key") as info:
            async with pgbroker.atransaction(caller.db):
                app.tasks["t.add"].delay(1, 2)
                await caller.execute("INSERT INTO public.things VALUES ('taken')")
        assert "pgbroker" not in str(info.value)
        assert pgbroker_inserts() == []  # the transaction can only roll back: nothing sent
        await caller.rollback()
    assert jobs(pg) == []


@asynchronous
async def test_a_cancelled_request_writes_nothing(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    """A request cancelled inside the block (a client that went away): CancelledError is no
    Exception, so the buffer is dropped, nothing is sent, and the connection stays usable."""
    inside = asyncio.Event()
    async with opened(kind, db_url) as caller:
        async def request() -> None:
            async with pgbroker.atransaction(caller.db):
                app.tasks["t.add"].delay(1, 1)
                inside.set()
                await asyncio.sleep(30)  # a long request: cancelled long before its end

        served = asyncio.create_task(request())
        await inside.wait()
        served.cancel()
        with pytest.raises(asyncio.CancelledError):
            await served
        assert pgbroker_inserts() == []
        await caller.rollback()
        assert await caller.execute("SELECT 1") == [(1,)]
    assert jobs(pg) == []


@asynchronous
async def test_autocommit_writes_each_statement_at_once(
        db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    """A psycopg AsyncConnection in autocommit mode has no transaction to join: each statement
    is its own, so batches go one by one (not pipelined) and are visible at once."""
    Recorder.log = []
    async with await psycopg.AsyncConnection.connect(
            db_url, autocommit=True, cursor_factory=AsyncRecorder) as conn:
        ids = await pgbroker.aenqueue_many(conn, [("t.add", (i, i)) for i in range(5)],
                                           app=app, batch_size=2)
        assert {r["id"] for r in jobs(pg)} == set(ids)
        async with pgbroker.atransaction(conn):
            published = app.tasks["t.add"].delay(9, 9)
        assert published.id in {r["task_id"] for r in jobs(pg)}
    inserts = pgbroker_inserts()
    assert len(inserts) == 4 and not any(in_pipeline for _, in_pipeline in inserts)


@asynchronous
async def test_a_commit_inside_atransaction(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    """SQLAlchemy: a commit inside the block writes the buffered jobs first, a rollback drops
    them. psycopg has no commit hook: leaving the block then raises rather than losing them."""
    add = app.tasks["t.add"]
    async with opened(kind, db_url) as caller:
        if kind == "async_psycopg":
            with pytest.raises(RuntimeError, match="transaction ended inside the block"):
                async with pgbroker.atransaction(caller.db):
                    add.delay(1, 1)
                    await caller.commit()
            assert jobs(pg) == []
            return
        async with pgbroker.atransaction(caller.db):
            first = add.delay(1, 1)
            await caller.commit()
            assert [r["task_id"] for r in jobs(pg)] == [first.id]
            second = add.delay(2, 2)
            await caller.rollback()  # drops what was buffered since the commit
            third = add.delay(3, 3)
        await caller.commit()
    assert [r["task_id"] for r in jobs(pg)] == [first.id, third.id]
    assert second.id not in {r["task_id"] for r in jobs(pg)}


@pytest.mark.parametrize("fails", [False, True], ids=["commits", "raises"])
@asynchronous
async def test_the_readme_example_a_transaction_block_of_the_callers_library(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection, fails: bool) -> None:  # noqa: F811
    """As in the README's FastAPI example: aenqueue and an atransaction block inside the
    library's own transaction block (``db.begin()``, psycopg's ``conn.transaction()``), whose
    commit writes both jobs with the application's row, and whose exception rolls all back."""
    async with opened(kind, db_url) as caller:
        own = caller.db.transaction() if kind == "async_psycopg" else caller.db.begin()
        with contextlib.suppress(LookupError):
            async with own:
                await caller.execute("INSERT INTO public.things VALUES ('confirmed')")
                await pgbroker.aenqueue(caller.db, "t.pay", (1,), app=app,
                                        idempotency_key="email:1:confirmed")
                async with pgbroker.atransaction(caller.db):
                    app.tasks["t.add"].delay(1, 1)
                if fails:
                    raise LookupError("the request fails after its jobs were written")
    assert sorted(r["task"] for r in jobs(pg)) == ([] if fails else ["t.add", "t.pay"])
    assert things(pg) == ([] if fails else ["confirmed"])


@asynchronous
async def test_concurrent_requests_each_write_in_their_own_transaction(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    """Two requests served at once by one event loop (asyncio tasks), each with its connection:
    each one's publishes go to its own transaction; a task that was not started inside a block
    publishes through the broker's own connection, visible at once."""
    add = app.tasks["t.add"]
    both_inside = asyncio.Barrier(3)

    async def request(name: str, commits: bool) -> str:
        async with opened(kind, db_url) as caller:
            async with pgbroker.atransaction(caller.db):
                published = add.delay(len(name), 0)
                await both_inside.wait()
                await both_inside.wait()
            await (caller.commit() if commits else caller.rollback())
        return published.id

    async def outsider() -> str:
        await both_inside.wait()
        published = add.delay(0, 0)  # while both blocks are open, from a task outside them
        assert [r["task_id"] for r in jobs(pg)] == [published.id]
        await both_inside.wait()
        return published.id

    kept, dropped, direct = await asyncio.gather(
        request("kept", True), request("dropped", False), outsider())
    assert {r["task_id"] for r in jobs(pg)} == {kept, direct}
    assert add.delay(9, 9).id in {r["task_id"] for r in jobs(pg)}  # after the blocks: the broker


@asynchronous
async def test_atransaction_blocks_nest_like_transaction_blocks(
        kind: str, db_url: str, app: Celery, pg: psycopg.Connection) -> None:  # noqa: F811
    """The innermost block takes the publishes, and writes them when it is left; leaving it
    gives the outer block back its own. A synchronous ``transaction(conn)`` nests the same way
    (inside it, publishes go to ``conn``); ``aenqueue``, and ``enqueue`` on a synchronous
    connection, write at once on their own ``db`` whatever block is open."""
    add = app.tasks["t.add"]
    async with opened(kind, db_url) as caller:
        with psycopg.connect(db_url) as other:
            async with pgbroker.atransaction(caller.db):
                outer = add.delay(1, 1)
                async with pgbroker.atransaction(caller.db):
                    inner = add.delay(2, 2)
                assert len(pgbroker_inserts()) == 1  # the inner block's, on leaving it
                with pgbroker.transaction(other):
                    synced = add.delay(3, 3)
                direct = pgbroker.enqueue(other, add, (6, 6))  # its own db: written there now
                assert [r["id"] for r in rows_of(other, [direct])] == [direct]
                enqueued = await pgbroker.aenqueue(caller.db, add, (4, 4))
                assert len(pgbroker_inserts()) == 2  # (``other`` records nothing)
                after = add.delay(5, 5)  # the outer block's again
            assert jobs(pg) == []
            other.commit()
        assert {r["task_id"] for r in jobs(pg)} == {synced.id} | {
            r["task_id"] for r in jobs(pg) if r["id"] == direct}
        await caller.commit()
    rows = jobs(pg)
    assert {r["task_id"] for r in rows} == {outer.id, inner.id, synced.id, after.id} | {
        r["task_id"] for r in rows if r["id"] in (enqueued, direct)}
    assert len(rows) == 6


@asynchronous
async def test_an_unroutable_publish_in_atransaction_is_kept_in_the_callers_transaction(
        kind: str, db_url: str, broker_url: str, pg: psycopg.Connection) -> None:
    with kombu.Connection(broker_url) as conn:
        exchange = kombu.Exchange("orders", type="direct")
        kombu.Queue("bound", exchange, routing_key="bound")(conn.default_channel).declare()
        producer = kombu.Producer(conn.default_channel)
        for commits in (False, True):
            async with opened(kind, db_url) as caller:
                with pytest.warns(Warning, match="nobody"):
                    async with pgbroker.atransaction(caller.db):
                        producer.publish({"n": 1}, exchange=exchange, routing_key="nobody",
                                         serializer="json")
                assert jobs(pg) == []
                await (caller.commit() if commits else caller.rollback())
            assert [(r["queue"], r["state"]) for r in jobs(pg)] == (
                [("pgbroker.unroutable", "dead")] if commits else [])
