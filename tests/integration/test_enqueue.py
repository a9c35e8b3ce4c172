"""Transactional, idempotent enqueue (issue 3) against a real PostgreSQL.

Every test that writes runs with the three kinds of caller connection pgbroker accepts: a
SQLAlchemy ``Session``, a SQLAlchemy ``Connection`` and a raw psycopg 3 connection (the
``caller`` fixture). What another session sees is read through ``pg`` (autocommit), so "not
visible before the commit" is checked, not assumed.

Figures (the bulk rate) are printed, not asserted: ``pytest -s tests/integration/test_enqueue.py``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, group
from kombu.serialization import loads
from psycopg.rows import dict_row
from sqlalchemy import create_engine

import pgbroker
from pgbroker.enqueue import _current_target  # the module; pgbroker.enqueue is the function
from pgbroker.errors import ConfigurationError, IdempotencyKeyRequired, MessageError, SchemaError
from tests.helpers import wait_for
from tests.integration.enqueue_support import KINDS, Caller, Recorder, pgbroker_inserts

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
    return pg.cursor(row_factory=dict_row).execute(
        "SELECT * FROM pgbroker.jobs ORDER BY created_at, id").fetchall()


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
               "properties", "body"}
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
        delay, queue = payload.split(" ")
        assert (float(delay), queue) == (0, "wake")
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

BAD_CALLS: list[tuple[str, Callable[[Any, Celery], Any], type[Exception], str]] = [
    ("args not a list", lambda db, app: pgbroker.enqueue(db, "t.add", "12", app=app),
     TypeError, "must be a list or tuple"),
    ("kwargs not a mapping", lambda db, app: pgbroker.enqueue(db, "t.add", (), [1], app=app),
     TypeError, "must be a mapping"),
    ("wrong arguments", lambda db, app: pgbroker.enqueue(db, app.tasks["t.add"], (1,)),
     TypeError, "missing"),
    ("not a task", lambda db, app: pgbroker.enqueue(db, 42, app=app), TypeError, "Celery task"),
    ("empty task name", lambda db, app: pgbroker.enqueue(db, "", app=app), MessageError, "empty"),
    ("bad queue", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app, queue="a\x00"),
     MessageError, "NUL"),
    ("bad priority", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app, priority=300),
     MessageError, "priority"),
    ("bad eta", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app, eta=5),
     MessageError, "eta must be"),
    ("unparsable eta", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app, eta="soon"),
     MessageError, "ISO 8601"),
    ("bad countdown", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app,
                                                       countdown="5"), MessageError, "countdown"),
    ("bad max_attempts", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app,
                                                          max_attempts=0),
     MessageError, "max_attempts"),
    ("bad headers", lambda db, app: pgbroker.enqueue(db, "t.add", (1, 2), app=app, headers=[1]),
     MessageError, "headers must be a mapping"),
    ("two different keys", lambda db, app: pgbroker.enqueue(
        db, "t.pay", (1,), app=app, idempotency_key="a", headers={"idempotency_key": "b"}),
     MessageError, "given twice"),
    ("unknown option", lambda db, app: pgbroker.enqueue_many(
        db, [("t.add", (1, 2), None, {"countdwn": 1})], app=app), TypeError, "countdwn"),
    ("bad item", lambda db, app: pgbroker.enqueue_many(db, ["t.add"], app=app),
     TypeError, "item 0"),
    ("bad options", lambda db, app: pgbroker.enqueue_many(db, [("t.add", (), None, 5)], app=app),
     TypeError, "options must be a dict"),
    ("bad batch size", lambda db, app: pgbroker.enqueue_many(db, [], app=app, batch_size=0),
     ValueError, "batch_size"),
    ("bad item among good ones", lambda db, app: pgbroker.enqueue_many(
        db, [("t.add", (1, 2)), ("t.pay", (1,)), ("t.add", (3, 4))], app=app),
     IdempotencyKeyRequired, "requires an idempotency key"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_before_anything_is_written(
        raw: Caller, app: Celery, pg: psycopg.Connection, call: Callable[[Any, Celery], Any],
        error: type[Exception], match: str) -> None:
    raw.execute("INSERT INTO public.things VALUES ('kept')")
    with pytest.raises(error, match=match):
        call(raw.db, app)
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
