"""Transactional, idempotent enqueue (issue 3) against a real PostgreSQL.

Every test that writes runs with the three kinds of caller connection pgbroker accepts: a
SQLAlchemy ``Session``, a SQLAlchemy ``Connection`` and a raw psycopg 3 connection (the
``caller`` fixture). What another session sees is read through ``pg`` (autocommit), so "not
visible before the commit" is checked, not assumed.

Figures (the bulk rate) are printed, not asserted: ``pytest -s tests/integration/test_enqueue.py``.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections import namedtuple
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, group
from celery._state import _task_stack
from kombu.exceptions import EncodeError
from kombu.serialization import loads
from psycopg.rows import dict_row
from sqlalchemy import create_engine

import pgbroker
from pgbroker._model.claimed import parse_wake
from pgbroker._produce.transaction import current_target as _current_target
from pgbroker.errors import ConfigurationError, IdempotencyKeyRequired, MessageError, SchemaError
from tests.support.processes import wait_for
from tests.support.enqueue import (
    KINDS, Caller, Recorder, comparable, pgbroker_inserts, rows_of)
from tests.support import db as support_db

CHANNEL = "pgbroker.jobs"


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(params=KINDS)
def caller(request: pytest.FixtureRequest, db_url: str, pg: psycopg.Connection) -> Iterator[Caller]:
    pg.execute("CREATE TABLE public.things (name text PRIMARY KEY)")
    Recorder.log = []
    c = Caller(request.param, db_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def raw(db_url: str, pg: psycopg.Connection) -> Iterator[Caller]:
    """The psycopg caller only: for checks that do not depend on the kind of connection."""
    pg.execute("CREATE TABLE public.things (name text PRIMARY KEY)")
    c = Caller("psycopg", db_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = Celery("enqueue_tests", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"require_idempotency_key": ["t.pay"]}
    app.conf.task_routes = {"t.slow_lane": {"queue": "slow", "priority": 7}}

    @app.task(name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="t.pay", shared=False)
    def pay(amount: int) -> int:
        return amount

    @app.task(name="t.slow_lane", shared=False)
    def slow_lane() -> None:
        return None

    try:
        yield app
    finally:
        app.close()


def jobs(pg: psycopg.Connection) -> list[dict[str, Any]]:
    return support_db.jobs(pg, order="created_at, id")


def things(pg: psycopg.Connection) -> list[str]:
    return [r[0] for r in pg.execute("SELECT name FROM public.things ORDER BY name")]


def decoded_body(row: dict[str, Any]) -> Any:
    return loads(bytes(row["body"]), row["content_type"], row["content_encoding"])


def listener(db_url: str) -> psycopg.Connection:
    conn = psycopg.connect(db_url, autocommit=True)
    conn.execute(f'LISTEN "{CHANNEL}"')
    return conn


def notifications(conn: psycopg.Connection, timeout: float) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout, stop_after=1)]


# -- the five rules ------------------------------------------------------------------------------

def test_plain_enqueue_is_a_celery_message_in_the_callers_transaction(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    caller.execute("INSERT INTO public.things VALUES ('order-1')")
    job_id = pgbroker.enqueue(caller.db, app.tasks["t.add"], (2, 3), queue="orders")
    assert isinstance(job_id, uuid.UUID)
    assert jobs(pg) == [] and things(pg) == []  # nothing visible before the commit
    caller.commit()

    [row] = jobs(pg)
    assert things(pg) == ["order-1"]
    assert row["id"] == job_id
    assert (row["queue"], row["task"], row["state"], row["retries"]) == (
        "orders", "t.add", "pending", 0)
    headers = row["headers"]
    # a Celery protocol-2 message: the worker reads the task, id and retries from the headers
    assert headers["task"] == "t.add" and headers["lang"] == "py"
    assert headers["id"] == row["task_id"] == row["properties"]["correlation_id"]
    assert headers["root_id"] == headers["id"] and headers["retries"] == 0
    args, kwargs, embed = decoded_body(row)
    assert (args, kwargs) == ([2, 3], {})
    assert set(embed) == {"callbacks", "errbacks", "chain", "chord"}


def test_enqueue_writes_what_apply_async_writes(raw: Caller, app: Celery,
                                                pg: psycopg.Connection) -> None:
    """Same headers, properties and columns as the transport's own publish (ids and times aside)."""
    task = app.tasks["t.slow_lane"]
    published = task.apply_async(countdown=60, headers={"idempotency_key": "a"})
    pgbroker.enqueue(raw.db, task, countdown=60, idempotency_key="b")
    raw.commit()

    first, second = jobs(pg)
    assert first["task_id"] == published.id
    differs = {"id", "task_id", "created_at", "updated_at", "run_at", "idempotency_key", "headers",
               "properties", "body", "message_digest"}
    assert {k: v for k, v in first.items() if k not in differs} == {
        k: v for k, v in second.items() if k not in differs}
    assert (second["queue"], second["priority"], second["state"]) == ("slow", 7, "scheduled")
    varying = {"id", "root_id", "correlation_id", "eta", "idempotency_key"}
    assert {k: v for k, v in first["headers"].items() if k not in varying} == {
        k: v for k, v in second["headers"].items() if k not in varying}
    # Only the AMQP per-message TTL is left out: enqueue carries expiry in the header alone.
    assert {k for k in first["properties"] if k != "expiration"} == set(second["properties"])
    assert decoded_body(first) == decoded_body(second)


def test_required_key_without_key_is_refused_and_the_transaction_still_works(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    caller.execute("INSERT INTO public.things VALUES ('refund-1')")
    with pytest.raises(ValueError, match="'t.pay' requires an idempotency key") as info:
        pgbroker.enqueue(caller.db, "t.pay", (10,), app=app)
    assert isinstance(info.value, IdempotencyKeyRequired)
    with pytest.raises(IdempotencyKeyRequired), pgbroker.transaction(caller.db):
        app.tasks["t.pay"].delay(10)
    caller.execute("INSERT INTO public.things VALUES ('refund-2')")
    caller.commit()
    assert things(pg) == ["refund-1", "refund-2"]
    assert jobs(pg) == []


def test_required_key_with_key_is_enqueued(caller: Caller, app: Celery,
                                           pg: psycopg.Connection) -> None:
    job_id = pgbroker.enqueue(caller.db, "t.pay", (10,), app=app, idempotency_key="refund-1")
    caller.commit()
    [row] = jobs(pg)
    assert (row["id"], row["task"], row["idempotency_key"]) == (job_id, "t.pay", "refund-1")
    assert row["headers"]["idempotency_key"] == "refund-1"


def test_duplicate_key_returns_the_existing_job_without_an_error(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    pay = app.tasks["t.pay"]
    first = pgbroker.enqueue(caller.db, pay, (10,), idempotency_key="refund-1")
    again = pgbroker.enqueue(caller.db, pay, (99,), idempotency_key="refund-1")
    assert again == first
    other_task = pgbroker.enqueue(caller.db, "t.add", (1, 2), app=app, idempotency_key="refund-1")
    assert other_task != first  # the key is unique per task, not globally
    # no exception aborted the transaction: it still runs statements and commits
    assert caller.execute("SELECT 41 + 1") == [(42,)]
    caller.execute("INSERT INTO public.things VALUES ('refund-1')")
    caller.commit()

    # and a duplicate of a committed job, from a later transaction
    assert pgbroker.enqueue(caller.db, pay, (7,), idempotency_key="refund-1") == first
    caller.commit()
    rows = jobs(pg)
    assert [r["id"] for r in rows] == [first, other_task]
    assert decoded_body(rows[0])[0] == [10]  # the first message is the one kept
    assert things(pg) == ["refund-1"]


@pytest.mark.parametrize("first_commits", [True, False], ids=["commit", "rollback"])
def test_concurrent_duplicate_waits_for_the_first_transaction(
        app: Celery, db_url: str, pg: psycopg.Connection, first_commits: bool) -> None:
    """The second transaction's insert waits on the first's uncommitted key: after a commit it
    gets the first job's id (no exception), after a rollback it inserts its own job."""
    with psycopg.connect(db_url) as first, psycopg.connect(db_url) as second:
        first_id = pgbroker.enqueue(first, "t.pay", (1,), app=app, idempotency_key="race")
        result: dict[str, Any] = {}

        def enqueue_second() -> None:
            try:
                result["id"] = pgbroker.enqueue(second, "t.pay", (2,), app=app,
                                                idempotency_key="race")
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                result["error"] = exc

        thread = threading.Thread(target=enqueue_second)
        thread.start()
        wait_for(lambda: pg.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'").fetchone()[0] == 1, 30,
            message="the second insert waiting on the first transaction's key")
        if first_commits:
            first.commit()
        else:
            first.rollback()
        thread.join(30)
        assert "error" not in result, result
        assert (result["id"] == first_id) is first_commits
        assert second.execute("SELECT 1").fetchone() == (1,)  # still usable
        second.commit()
    assert [r["id"] for r in jobs(pg)] == [result["id"]]


def test_explicit_future_eta_is_kept(caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    eta = datetime.now(timezone.utc).replace(microsecond=123456) + timedelta(hours=2)
    expires = eta + timedelta(hours=1)
    job_id = pgbroker.enqueue(caller.db, "t.add", (1, 1), app=app, eta=eta, expires=expires)
    soon = pgbroker.enqueue(caller.db, "t.add", (2, 2), app=app, countdown=30, expires=90)
    caller.commit()

    rows = {r["id"]: r for r in jobs(pg)}
    row = rows[job_id]
    assert row["state"] == "scheduled"
    assert row["run_at"] == eta and row["expires_at"] == expires
    assert datetime.fromisoformat(row["headers"]["eta"]) == eta
    assert datetime.fromisoformat(row["headers"]["expires"]) == expires
    later = rows[soon]
    assert later["state"] == "scheduled"
    delay = (later["run_at"] - later["created_at"]).total_seconds()
    assert 25 < delay <= 31, delay
    assert (later["expires_at"] - later["run_at"]).total_seconds() == pytest.approx(60, abs=0.01)


def test_caller_rollback_leaves_no_job_and_no_notification(
        caller: Caller, app: Celery, pg: psycopg.Connection, db_url: str) -> None:
    listen = listener(db_url)
    try:
        caller.execute("INSERT INTO public.things VALUES ('cancelled')")
        pgbroker.enqueue(caller.db, "t.add", (1, 2), app=app)
        pgbroker.enqueue_many(caller.db, [("t.add", (i, i)) for i in range(3)], app=app)
        caller.rollback()
        assert jobs(pg) == [] and things(pg) == []
        assert notifications(listen, 0.3) == []
    finally:
        listen.close()


def test_wake_up_notification_is_delivered_only_at_commit(
        caller: Caller, app: Celery, pg: psycopg.Connection, db_url: str) -> None:
    listen = listener(db_url)
    try:
        pgbroker.enqueue(caller.db, "t.add", (1, 2), app=app, queue="wake")
        assert notifications(listen, 0.5) == []  # the transaction is still open
        caller.commit()
        [payload] = notifications(listen, 30)
        kind, queue = payload.split(" ")
        # the delay, and the job's place in the claim order (0014_claim_cursor.sql)
        (run_at,) = pg.execute("SELECT run_at FROM pgbroker.jobs WHERE queue = 'wake'").fetchone()
        assert (parse_wake(kind), queue) == ((0, (0, run_at, uuid.UUID(int=0))), "wake")
    finally:
        listen.close()


# -- pgbroker.transaction ------------------------------------------------------------------------

def test_transaction_routes_delay_send_task_chain_and_group(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    add = app.tasks["t.add"]
    with pgbroker.transaction(caller.db):
        caller.execute("INSERT INTO public.things VALUES ('basket')")
        single = add.delay(1, 2)
        sent = app.send_task("t.add", (3, 4))
        chained = chain(add.s(1, 1), add.s(10)).apply_async()
        grouped = group(add.s(i, i) for i in range(5)).apply_async()
        assert jobs(pg) == []  # buffered, and then written in the caller's transaction
    assert jobs(pg) == []
    caller.commit()

    rows = jobs(pg)
    assert things(pg) == ["basket"]
    by_task_id = {r["task_id"]: r for r in rows}
    assert len(rows) == 8
    assert {single.id, sent.id, chained.parent.id} | {r.id for r in grouped.results} == set(
        by_task_id)
    assert decoded_body(by_task_id[chained.parent.id])[2]["chain"]  # the rest of the chain
    assert {by_task_id[r.id]["headers"]["group"] for r in grouped.results} == {grouped.id}
    # one statement for the whole block: the group of 5 is not 5 round trips
    assert len(pgbroker_inserts()) == 1


def test_transaction_rollback_leaves_nothing(caller: Caller, app: Celery,
                                             pg: psycopg.Connection) -> None:
    add = app.tasks["t.add"]
    with pgbroker.transaction(caller.db):
        caller.execute("INSERT INTO public.things VALUES ('basket')")
        add.delay(1, 2)
        group(add.s(i, i) for i in range(3)).apply_async()
    caller.rollback()
    with pytest.raises(ZeroDivisionError), pgbroker.transaction(caller.db):
        add.delay(3, 4)
        1 / 0  # noqa: B018 - the application fails inside the block
    caller.rollback()
    assert jobs(pg) == [] and things(pg) == []


def test_transaction_is_per_thread_and_ends_with_the_block(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    add = app.tasks["t.add"]
    with pgbroker.transaction(caller.db):
        inside = add.delay(1, 1)
        elsewhere = threading.Thread(target=lambda: add.delay(2, 2))
        elsewhere.start()
        elsewhere.join()
        # the other thread published through the broker's own (autocommit) connection
        [other] = jobs(pg)
        assert other["task_id"] != inside.id
    after = add.delay(3, 3)  # after the block: the broker's connection again, visible at once
    assert after.id in {r["task_id"] for r in jobs(pg)}
    caller.rollback()
    assert inside.id not in {r["task_id"] for r in jobs(pg)}
    assert _current_target() is None


def test_commit_inside_the_block(caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    """SQLAlchemy: a commit inside the block writes the buffered jobs first. psycopg has no commit
    hook: leaving the block then raises rather than losing the jobs silently."""
    add = app.tasks["t.add"]
    if caller.kind == "psycopg":
        with pytest.raises(RuntimeError, match="transaction ended inside the block"):
            with pgbroker.transaction(caller.db):
                add.delay(1, 1)
                caller.commit()
        assert jobs(pg) == []
        return
    with pgbroker.transaction(caller.db):
        first = add.delay(1, 1)
        caller.commit()
        assert [r["task_id"] for r in jobs(pg)] == [first.id]
        second = add.delay(2, 2)
        caller.rollback()  # drops what was buffered since the commit
        third = add.delay(3, 3)
    caller.commit()
    assert [r["task_id"] for r in jobs(pg)] == [first.id, third.id]
    assert second.id not in {r["task_id"] for r in jobs(pg)}


def test_idempotency_key_header_is_honoured_everywhere(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    pay = app.tasks["t.pay"]
    with pgbroker.transaction(caller.db):
        pay.apply_async((1,), headers={"idempotency_key": "in-tx"})
        pay.apply_async((2,), headers={"idempotency_key": "in-tx"})
        group(pay.s(i).set(headers={"idempotency_key": "grouped"}) for i in range(3)).apply_async()
    key_of_enqueue = pgbroker.enqueue(caller.db, pay, (3,), idempotency_key="in-tx")
    caller.commit()
    # through the broker's own connection, outside any transaction block
    pay.apply_async((4,), headers={"idempotency_key": "broker"})
    pay.apply_async((5,), headers={"idempotency_key": "broker"})

    rows = jobs(pg)
    assert sorted(r["idempotency_key"] for r in rows) == ["broker", "grouped", "in-tx"]
    [in_tx] = [r for r in rows if r["idempotency_key"] == "in-tx"]
    assert key_of_enqueue == in_tx["id"] and decoded_body(in_tx)[0] == [1]


def test_a_producers_publish_retry_makes_no_second_copy(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    """The same message published twice (a retry after a lost connection) is one row; Celery's
    retry() (same task id, retries + 1) is a new one."""
    add = app.tasks["t.add"]
    task_id = str(uuid.uuid4())
    add.apply_async((1, 2), task_id=task_id)
    add.apply_async((1, 2), task_id=task_id)
    add.apply_async((1, 2), task_id=task_id, retries=1)
    in_tx = str(uuid.uuid4())
    with pgbroker.transaction(caller.db):
        add.apply_async((3, 4), task_id=in_tx)
        add.apply_async((3, 4), task_id=in_tx)
    with pgbroker.transaction(caller.db):
        add.apply_async((3, 4), task_id=in_tx)  # a second statement in the same transaction
        add.apply_async((3, 4), task_id=in_tx, retries=1)
    caller.commit()
    assert sorted((r["task_id"], r["retries"]) for r in jobs(pg)) == sorted(
        [(task_id, 0), (task_id, 1), (in_tx, 0), (in_tx, 1)])


# -- bulk ----------------------------------------------------------------------------------------

def test_enqueue_many_10000_jobs_one_round_trip_per_batch(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    items = [("t.add", (i, i), None, {"priority": i % 10}) for i in range(10_000)]
    started = time.perf_counter()
    ids = pgbroker.enqueue_many(caller.db, items, app=app, batch_size=1000)
    caller.commit()
    elapsed = time.perf_counter() - started

    inserts = pgbroker_inserts()
    assert len(inserts) == 10  # one statement per batch of 1000
    assert len(ids) == len(set(ids)) == 10_000
    count, inserted = pg.execute(
        "SELECT count(*), count(*) FILTER (WHERE id = ANY(%s)) FROM pgbroker.jobs",
        (ids,)).fetchone()
    assert count == inserted == 10_000
    print(f"\n[figure] enqueue_many of 10,000 jobs ({caller.kind}, batches of 1000, commit "
          f"included): {elapsed:.2f}s, {10_000 / elapsed:,.0f} jobs/s")


def test_enqueue_many_with_keys_resolves_duplicates_in_the_same_round_trip(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    existing = pgbroker.enqueue(caller.db, "t.pay", (0,), app=app, idempotency_key="k0")
    items = [("t.pay", (i,), None, {"idempotency_key": f"k{i % 50}"}) for i in range(100)]
    items.append((app.tasks["t.add"], (1, 2)))
    Recorder.log = []
    ids = pgbroker.enqueue_many(caller.db, items, app=app)
    caller.commit()

    assert ids[0] == ids[50] == existing  # a duplicate of a job of the same transaction
    assert ids[1:50] == ids[51:100]  # duplicates inside the batch
    assert len(set(ids)) == 51
    assert len(jobs(pg)) == 51
    statements = [entry for entry in Recorder.log if '"pgbroker".jobs' in entry[0]]
    assert len(statements) == 2 and all(in_pipeline for _, in_pipeline in statements)


# -- bad input: a clear error, nothing written, the caller's transaction intact -----------------
#
# Each call takes ``api``: pgbroker for enqueue and enqueue_many (here), or their asyncio forms
# aenqueue and aenqueue_many (tests/integration/test_aenqueue.py, which awaits the call).

BAD_CALLS: list[tuple[str, Callable[[Any, Any, Celery], Any], type[Exception], str]] = [
    ("args not a list", lambda api, db, app: api.enqueue(db, "t.add", "12", app=app),
     TypeError, "must be a list or tuple"),
    ("kwargs not a mapping", lambda api, db, app: api.enqueue(db, "t.add", (), [1], app=app),
     TypeError, "must be a mapping"),
    ("wrong arguments", lambda api, db, app: api.enqueue(db, app.tasks["t.add"], (1,)),
     TypeError, "missing"),
    ("not a task", lambda api, db, app: api.enqueue(db, 42, app=app), TypeError, "Celery task"),
    ("empty task name", lambda api, db, app: api.enqueue(db, "", app=app), MessageError, "empty"),
    ("bad queue", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app, queue="a\x00"),
     MessageError, "NUL"),
    ("bad priority", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app, priority=300),
     MessageError, "priority"),
    ("bad eta", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app, eta=5),
     MessageError, "eta must be"),
    ("unparsable eta", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app, eta="soon"),
     MessageError, "ISO 8601"),
    ("bad countdown", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app,
                                                       countdown="5"), MessageError, "countdown"),
    ("bad max_attempts", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app,
                                                          max_attempts=0),
     MessageError, "max_attempts"),
    ("bad headers", lambda api, db, app: api.enqueue(db, "t.add", (1, 2), app=app, headers=[1]),
     MessageError, "headers must be a mapping"),
    ("two different keys", lambda api, db, app: api.enqueue(
        db, "t.pay", (1,), app=app, idempotency_key="a", headers={"idempotency_key": "b"}),
     MessageError, "given twice"),
    ("unknown option", lambda api, db, app: api.enqueue_many(
        db, [("t.add", (1, 2), None, {"countdwn": 1})], app=app), TypeError, "countdwn"),
    ("bad item", lambda api, db, app: api.enqueue_many(db, ["t.add"], app=app),
     TypeError, "item 0"),
    ("bad options", lambda api, db, app: api.enqueue_many(db, [("t.add", (), None, 5)], app=app),
     TypeError, "options must be a dict"),
    ("bad batch size", lambda api, db, app: api.enqueue_many(db, [], app=app, batch_size=0),
     ValueError, "batch_size"),
    ("bad item among good ones", lambda api, db, app: api.enqueue_many(
        db, [("t.add", (1, 2)), ("t.pay", (1,)), ("t.add", (3, 4))], app=app),
     IdempotencyKeyRequired, "requires an idempotency key"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_before_anything_is_written(
        raw: Caller, app: Celery, pg: psycopg.Connection,
        call: Callable[[Any, Any, Celery], Any], error: type[Exception], match: str) -> None:
    raw.execute("INSERT INTO public.things VALUES ('kept')")
    with pytest.raises(error, match=match):
        call(pgbroker, raw.db, app)
    raw.execute("INSERT INTO public.things VALUES ('kept too')")
    raw.commit()
    assert things(pg) == ["kept", "kept too"] and jobs(pg) == []


def test_unsupported_connections_are_refused(app: Celery) -> None:
    sqlite = create_engine("sqlite://")
    try:
        with sqlite.connect() as conn, pytest.raises(TypeError, match="psycopg 3 driver"):
            pgbroker.enqueue(conn, "t.add", (1, 2), app=app)
    finally:
        sqlite.dispose()
    with pytest.raises(TypeError, match="not builtins.object"):
        pgbroker.enqueue(object(), "t.add", (1, 2), app=app)
    with pytest.raises(TypeError, match="not builtins.str"), pgbroker.transaction("db"):
        pass


def test_an_app_without_a_pgbroker_broker_is_refused(raw: Caller) -> None:
    other = Celery("memory_app", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="uses the 'memory' broker"):
        pgbroker.enqueue(raw.db, "t.add", (1, 2), app=other)
    unknown = Celery("unknown_app", broker="nosuchbroker://localhost", set_as_current=False)
    with pytest.raises(ConfigurationError, match="cannot tell the broker"):
        pgbroker.enqueue(raw.db, "t.add", (1, 2), app=unknown)


def test_a_database_without_the_schema_is_a_clear_error(raw: Caller, broker_url: str) -> None:
    app = Celery("elsewhere", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": "not_migrated"}
    with pytest.raises(SchemaError, match="no pgbroker schema 'not_migrated'"):
        pgbroker.enqueue(raw.db, "t.add", (1, 2), app=app)


# -- enqueue_many's templates (issue 9): the same messages, made faster --------------------------
#
# enqueue_many makes the first job of each kind (app, task, queue, priority, max_attempts, with or
# without a key) with _build, as enqueue does, and the others from it. These tests compare what it
# writes with what enqueue writes and with what Celery's own apply_async writes (through
# pgbroker.transaction), field by field, for a mix of tasks, arguments and options.

Point = namedtuple("Point", "x y")

#: Arguments saferepr writes in every way it has: plain, quoted, escaped, nested past
#: task_repr_maxlevels, cut at argsrepr_maxsize (1024), and types it writes in its own way.
ARGS: list[Any] = [
    (), [], (1, 2), [3, 4], (None,), ((1,),), (True, False, 0, -5, 2**70, 1.5, -0.0, 1e300),
    ("it's", 'say "hi"', "back\\slash", "new\nline\ttab", "ünïcødé ☃ \U0001F600", "", "'"),
    ([1, [2, [3, [4, [5]]]]],), ({"a": {"b": {"c": {"d": 1}}}},), ({"k'ey": ["v", ("w",)]},),
    ("x" * 2000,), (list(range(500)),), ("word " * 300,), ("y" * 1018,), ("y" * 1019,),
    ("y" * 1020,), ("y" * 1023,),  # a repr of 1023, 1024, 1025, 1028 characters
    ("z" * 1030, 1), (b"bytes", b"\xff\xfe"), (Decimal("1.50"),), (Point(1, 2),),
    (datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc),), (uuid.UUID(int=7),), ({1: "int key"},),
    (float("nan"), float("inf")),
]
KWARGS: list[Any] = [None, {}, {"k": 1}, {"quote'key": "v'al", "nested": [1, {"x": None}]},
                     {"long": "w" * 1500}, {"deep": [[[[["bottom"]]]]]}]
#: Options of each kind enqueue_many makes from a template, then the per-job ones (_build).
TEMPLATE_OPTIONS: list[dict[str, Any]] = [
    {}, {"queue": "other"}, {"priority": 3}, {"max_attempts": 2}, {"queue": "q2", "priority": 9},
    {"priority": None, "countdown": None}]
PER_JOB_OPTIONS: list[dict[str, Any]] = [
    {"countdown": 30}, {"eta": datetime(2031, 1, 1, tzinfo=timezone.utc)}, {"expires": 300},
    {"headers": {"x-custom": "1"}}]


def _takes_anything(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def mixed_app(broker_url: str) -> Iterator[Celery]:
    """Tasks with each execution option that changes a message, and routes by name."""
    app = Celery("enqueue_mixed", broker=broker_url, set_as_current=False)
    app.conf.task_routes = {"t.slow_lane": {"queue": "slow", "priority": 7},
                            "t.glob.*": {"queue": "globbed"}}
    for name, options in [("t.echo", {}), ("t.slow_lane", {}), ("t.glob.one", {}),
                          ("t.pickled", {"serializer": "pickle"}),
                          ("t.zipped", {"compression": "zlib"}),
                          ("t.limited", {"time_limit": 30, "soft_time_limit": 20,
                                         "ignore_result": True}),
                          ("t.expiring", {"expires": 600})]:
        app.task(name=name, shared=False, **options)(_takes_anything)

    @app.task(name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    try:
        yield app
    finally:
        app.close()


def mixed_items(app: Celery) -> list[tuple[Any, ...]]:
    """(task, args, kwargs, options) of every kind, as objects and as names."""
    tasks: list[Any] = [app.tasks[name] for name in (
        "t.echo", "t.slow_lane", "t.glob.one", "t.pickled", "t.zipped", "t.limited",
        "t.expiring")] + ["t.echo", "remote.not_registered", "remote.100%_sure"]
    items: list[tuple[Any, ...]] = []
    for i, args in enumerate(ARGS):
        for j, task in enumerate(tasks):
            kwargs = KWARGS[(i + j) % len(KWARGS)]
            options = TEMPLATE_OPTIONS[(i * 3 + j) % len(TEMPLATE_OPTIONS)]
            items.append((task, args, kwargs, dict(options)))
    items += [(app.tasks["t.add"], (i, i)) for i in range(5)] + [("t.add", [1, 2], {})]
    items += [("t.echo", (i,), None, {"idempotency_key": f"key-{i}", "priority": i % 2})
              for i in range(6)]
    items += [("t.echo", (i,), {"n": i}, options) for i, options in enumerate(PER_JOB_OPTIONS)]
    return items


def _count_build(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the messages enqueue_many makes with _build (instrumented: the real one runs)."""
    module = sys.modules["pgbroker._produce.build"]
    real, calls = module.build, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "build", counted)
    return calls


def test_enqueue_many_writes_the_rows_enqueue_writes(
        raw: Caller, mixed_app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    items = mixed_items(mixed_app)
    built = _count_build(monkeypatch)
    ids = pgbroker.enqueue_many(raw.db, items, app=mixed_app, batch_size=100)
    many = rows_of(raw.conn, ids)
    raw.rollback()
    # most messages were made from a template: one _build per kind, and per per-job option
    assert len(items) > 200 and built[0] < 100
    single = [pgbroker.enqueue(raw.db, item[0], *item[1:3], **item[3] if len(item) > 3 else {},
                               app=mixed_app) for item in items]
    rows = rows_of(raw.conn, single)
    raw.rollback()

    for item, got, expected in zip(items, many, rows, strict=True):
        assert comparable(got) == comparable(expected), item
        assert got["headers"]["root_id"] == got["task_id"]
        assert got["run_at"] >= got["created_at"]
    assert len({row["task_id"] for row in many}) == len(items)
    # the arguments saferepr cuts were cut
    assert {len(r["headers"]["argsrepr"]) for r in many} & set(range(1024, 1100))
    assert any(r["headers"]["argsrepr"].endswith("...)") for r in many)


def test_enqueue_many_writes_what_apply_async_writes(
        raw: Caller, mixed_app: Celery) -> None:
    """Celery's own publish (through pgbroker.transaction), in the same transaction: the rows
    are the same but for the ids made for each message."""
    items = [item for item in mixed_items(mixed_app) if not str(item[0]).startswith("remote.")
             and not set(item[3] if len(item) > 3 else {}) - {"queue", "priority"}]
    ids = pgbroker.enqueue_many(raw.db, items, app=mixed_app)
    with pgbroker.transaction(raw.db):
        sent = []
        for task, args, *rest in items:
            kwargs, options = rest[0] if rest else None, rest[1] if len(rest) > 1 else {}
            task = mixed_app.tasks[task] if isinstance(task, str) else task
            sent.append(task.apply_async(args, kwargs, **options).id)
    ours = rows_of(raw.conn, ids)
    theirs = {row["task_id"]: row for row in raw.conn.cursor(row_factory=dict_row).execute(
        "SELECT * FROM pgbroker.jobs WHERE task_id = ANY(%s)", (sent,))}
    for item, got, task_id in zip(items, ours, sent, strict=True):
        expected = theirs[task_id]
        if item[0] is mixed_app.tasks["t.expiring"]:  # expires: the time of each publish
            assert got["headers"]["expires"] and got["expires_at"]
            assert expected["properties"].pop("expiration")  # AMQP TTL: enqueue writes none
            got, expected = comparable(got), comparable(expected)
        else:
            got, expected = comparable(got, times=True), comparable(expected, times=True)
        assert got == expected, item


def test_enqueue_many_in_a_task_takes_its_root_and_parent(
        raw: Caller, mixed_app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Called from a task a worker runs: the root and parent ids are the running task's, for
    the messages made from a template too."""
    parent = mixed_app.tasks["t.echo"]
    parent.push_request(id="parent-id", root_id="root-id", called_directly=False)
    _task_stack.push(parent)
    try:
        assert mixed_app.current_worker_task is parent
        built = _count_build(monkeypatch)
        ids = pgbroker.enqueue_many(raw.db, [("t.add", (i, i)) for i in range(5)], app=mixed_app)
        assert built[0] == 1
        single = pgbroker.enqueue(raw.db, "t.add", (0, 0), app=mixed_app)
    finally:
        _task_stack.pop()
        parent.pop_request()
    rows = rows_of(raw.conn, [*ids, single])
    assert {(r["headers"]["root_id"], r["headers"]["parent_id"]) for r in rows} == {
        ("root-id", "parent-id")}
    assert comparable(rows[0]) == comparable(rows[-1])
    assert [decoded_body(r)[0] for r in rows[:5]] == [[i, i] for i in range(5)]


def test_a_router_that_reads_the_arguments_routes_each_job(
        raw: Caller, mixed_app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    def by_parity(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                  **_: Any) -> dict[str, Any]:
        return {"queue": f"parity-{args[0] % 2}"} if name == "t.echo" else {}

    mixed_app.conf.task_routes = (by_parity,)
    built = _count_build(monkeypatch)
    ids = pgbroker.enqueue_many(raw.db, [("t.echo", (i,)) for i in range(6)], app=mixed_app)
    assert built[0] == 6  # no template: the router may route each job elsewhere
    assert [r["queue"] for r in rows_of(raw.conn, ids)] == ["parity-0", "parity-1"] * 3


def test_enqueue_many_checks_each_job_as_enqueue_does(raw: Caller, mixed_app: Celery,
                                                   pg: psycopg.Connection) -> None:
    """A job made from a template is checked as _build checks it: its arguments, its size,
    its serialization; the error is the same, and nothing is written."""
    add = mixed_app.tasks["t.add"]
    good = [(add, (i, i)) for i in range(1500)] + [
        ("t.echo", (0,), None, {"priority": 1, "max_attempts": 1})]
    cases: list[tuple[tuple[Any, ...], type[Exception]]] = [
        ((add, (1,)), TypeError),                      # the task's signature
        ((add, (1, 2, 3)), TypeError),
        ((add, (1,), {"x": 1}), TypeError),
        (("t.echo", ({1, 2},)), EncodeError),           # JSON has no sets
        (("t.echo", (2**20000,)), MessageError),       # too long for str(): as_task_v2's error
        (("t.echo", ("x" * 17_000_000,)), MessageError),  # over max_message_size
        (("t.echo", (0,), None, {"priority": True}), MessageError),  # True == 1, yet refused
        (("t.echo", (0,), None, {"max_attempts": True}), MessageError),
    ]
    for bad, error in cases:
        with pytest.raises(error) as expected:
            pgbroker.enqueue(raw.db, bad[0], *bad[1:3], **(bad[3] if len(bad) > 3 else {}),
                             app=mixed_app)
        with pytest.raises(error) as got:
            pgbroker.enqueue_many(raw.db, [*good, bad, *good], app=mixed_app)
        assert str(got.value) == str(expected.value)
    assert raw.execute("SELECT count(*) FROM pgbroker.jobs") == [(0,)]
    raw.commit()
    assert jobs(pg) == []


# -- enqueue_many: batches pipelined inside a transaction ----------------------------------------

def test_batches_are_pipelined_and_duplicates_resolved_across_them(
        caller: Caller, app: Celery, pg: psycopg.Connection) -> None:
    existing = pgbroker.enqueue(caller.db, "t.pay", (0,), app=app, idempotency_key="k1")
    Recorder.log = []
    items = [("t.pay", (i,), None, {"idempotency_key": f"k{i % 700}"}) for i in range(2500)]
    ids = pgbroker.enqueue_many(caller.db, items, app=app, batch_size=1000)
    caller.commit()

    statements = [entry for entry in Recorder.log if '"pgbroker".jobs' in entry[0]]
    assert len(statements) == 6 and all(in_pipeline for _, in_pipeline in statements)
    assert ids[1] == ids[701] == ids[2101] == existing  # a duplicate of an earlier statement
    assert all(ids[i] == ids[i % 700] for i in range(2500))
    assert len(set(ids)) == 700 and len(jobs(pg)) == 700
    rows = {r["id"]: r for r in jobs(pg)}
    assert all(decoded_body(rows[ids[i]])[0] == [i] for i in range(2, 700))  # the first kept


def test_autocommit_batches_go_one_by_one(app: Celery, db_url: str,
                                          pg: psycopg.Connection) -> None:
    """No transaction to pipeline into: each batch is a statement, and a transaction, of its
    own, as before."""
    Recorder.log = []
    with psycopg.connect(db_url, autocommit=True, cursor_factory=Recorder) as conn:
        ids = pgbroker.enqueue_many(conn, [("t.add", (i, i)) for i in range(2500)], app=app)
    inserts = pgbroker_inserts()
    assert len(inserts) == 3 and not any(in_pipeline for _, in_pipeline in inserts)
    assert sorted(r["id"] for r in jobs(pg)) == sorted(ids)


def test_a_failed_batch_fails_the_pipelined_write(raw: Caller, app: Celery,
                                                  pg: psycopg.Connection) -> None:
    """A statement PostgreSQL refuses (here a trigger refuses one job) raises what the per-job
    path raises, though the batches after it were already sent."""
    pg.execute("""
        CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.headers->>'argsrepr' LIKE '%refuse-me%' THEN
                RAISE EXCEPTION 'refused';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse BEFORE INSERT ON pgbroker.jobs FOR EACH ROW
            EXECUTE FUNCTION public.refuse()""")
    with pytest.raises(psycopg.Error) as expected:
        pgbroker.enqueue(raw.db, "t.add", ("refuse-me", "b"), app=app)
    raw.rollback()
    items = [("t.add", (i, i)) for i in range(2500)]
    items[1200] = ("t.add", ("refuse-me", "b"))
    with pytest.raises(psycopg.Error) as got:
        pgbroker.enqueue_many(raw.db, items, app=app)
    assert type(got.value) is type(expected.value)
    assert raw.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    raw.rollback()
    assert jobs(pg) == []


def test_a_database_without_the_schema_fails_the_pipelined_write(
        raw: Caller, broker_url: str) -> None:
    app = Celery("elsewhere", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": "not_migrated"}
    with pytest.raises(SchemaError, match="no pgbroker schema 'not_migrated'"):
        pgbroker.enqueue_many(raw.db, [("t.add", (i, i)) for i in range(2500)], app=app)


def test_another_client_encoding_is_sent_by_psycopg(raw: Caller, mixed_app: Celery,
                                                    pg: psycopg.Connection) -> None:
    """The text columns are made here in UTF-8 only; a LATIN1 connection gets psycopg's own."""
    raw.execute("SET client_encoding = 'LATIN1'")
    items = [("t.echo", ("café",), None, {"queue": "café", "idempotency_key": f"clé-{i}"})
             for i in range(3)]
    ids = pgbroker.enqueue_many(raw.db, items, app=mixed_app)
    single = pgbroker.enqueue(raw.db, "t.echo", ("café",), queue="café", idempotency_key="clé",
                              app=mixed_app)
    raw.commit()
    rows = rows_of(pg, [*ids, single])  # (psycopg reads jsonb as UTF-8: read it in UTF-8)
    assert [r["idempotency_key"] for r in rows] == ["clé-0", "clé-1", "clé-2", "clé"]
    assert {r["queue"] for r in rows} == {"café"}
    assert len({str(comparable({**r, "idempotency_key": None, "headers": {
        **r["headers"], "idempotency_key": None}})) for r in rows}) == 1


def test_a_client_side_binding_connection_gets_psycopgs_lists(
        app: Celery, db_url: str, pg: psycopg.Connection) -> None:
    """Django's default cursors bind client-side (literals in the SQL): the columns are then
    psycopg's own lists, pipelined all the same."""
    with psycopg.connect(db_url, cursor_factory=psycopg.ClientCursor) as conn:
        existing = pgbroker.enqueue(conn, "t.pay", (0,), app=app, idempotency_key="k1")
        ids = pgbroker.enqueue_many(conn, [
            *[("t.pay", (i,), None, {"idempotency_key": f"k{i % 700}"}) for i in range(2500)],
            *[("t.add", (i, i)) for i in range(1200)]], app=app)
    assert ids[1] == ids[2101] == existing
    rows = {r["id"]: r for r in jobs(pg)}
    assert len(rows) == 700 + 1200 and set(ids) == set(rows)
    assert decoded_body(rows[ids[-1]])[0] == [1199, 1199]
