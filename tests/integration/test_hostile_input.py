"""Hostile and careless input at publish (issue 18), against a real PostgreSQL, no worker.

Each case is either stored exactly (and handed back exactly on delivery) or refused at publish
with a ``MessageError`` that names the limit, through the transport (``.delay()``, kombu) and
through ``pgbroker.enqueue``, whose check comes before any statement so that the caller's
transaction stays usable. The cases with real workers are in tests/e2e/test_hostile_input.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery
from celery.utils.saferepr import saferepr
from kombu.transport.virtual.base import UndeliverableWarning

import pgbroker
from pgbroker._model.text import ESCAPED, MAX_NESTING, unescape
from pgbroker.errors import ConfigurationError, IdempotencyKeyRequired, MessageError, SchemaError
from pgbroker.sweeper import Sweeper
from pgbroker.transport import UNROUTABLE
from tests.support.processes import REPO_ROOT
from tests.support.transport import Collector, connect, jobs, publish, store_for

SURROGATE = b"caf\xe9".decode("utf-8", "surrogateescape")  # os.listdir's name for b"caf\xe9"


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = Celery("hostile", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"require_idempotency_key": ["t.pay"]}

    @app.task(name="t.echo", shared=False)
    def echo(*args: Any) -> Any:
        return args

    @app.task(name="t.pay", shared=False)
    def pay(amount: int) -> int:
        return amount

    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def caller(db_url: str) -> Iterator[psycopg.Connection]:
    """The application's own connection, in a transaction (never autocommit)."""
    with psycopg.connect(db_url) as conn:
        yield conn


def deliver_one(broker_url: str, queue: str = "celery") -> kombu.Message:
    """The first message of ``queue`` through kombu, as a consumer sees it (acked)."""
    with connect(broker_url) as conn:
        collector = Collector(conn, [queue], ack=True)
        return collector.take(1)[0][1]  # (one drain hands over all that one claim took)


def nested(depth: int) -> dict[str, Any]:
    """A dict nested ``depth`` levels deep ({}: 1)."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def still_usable(conn: psycopg.Connection) -> None:
    """The caller's transaction was not aborted: it still runs statements."""
    assert conn.execute("SELECT 1").fetchone() == (1,)


# -- 5. legitimate input, stored exactly -----------------------------------------------------------

@pytest.mark.parametrize("arg", ["a\x00b", SURROGATE, ESCAPED + "x\\x00"],
                         ids=["nul", "surrogate", "looks-escaped"])
def test_an_argument_postgresql_text_cannot_hold_is_delivered_exactly(
        app: Celery, broker_url: str, pg: psycopg.Connection, arg: str) -> None:
    """Celery's argsrepr header holds the argument as text; jsonb has no NUL, UTF-8 no
    surrogates. It works on RabbitMQ, so here too: stored escaped, delivered as sent."""
    result = app.tasks["t.echo"].delay(arg)
    [row] = jobs(pg)
    assert row["task_id"] == result.id and row["state"] == "pending"
    assert unescape(row["headers"]["argsrepr"]) == saferepr((arg,))  # what Celery wrote
    message = deliver_one(broker_url)
    assert message.headers["argsrepr"] == saferepr((arg,))
    assert message.decode()[0] == [arg]


def test_headers_and_properties_with_nul_and_surrogates_in_keys_and_values_round_trip(
        broker_url: str, pg: psycopg.Connection) -> None:
    headers = {"x-nul": "a\x00b", SURROGATE: [SURROGATE, {"k\x00": "v"}], "x-emoji": "🚀",
               "x-lookalike": ESCAPED + "\\x00"}
    with connect(broker_url) as conn:
        kombu.Producer(conn.default_channel).publish(
            {"n": 1}, routing_key="q", serializer="json", headers=headers,
            correlation_id="c\x00id", reply_to=SURROGATE)
    message = deliver_one(broker_url, "q")
    for key, value in headers.items():
        assert message.headers[key] == value
    assert message.properties["correlation_id"] == "c\x00id"
    assert message.properties["reply_to"] == SURROGATE


@pytest.mark.parametrize("kind", ["enqueue", "enqueue_many", "transaction"])
def test_enqueue_of_an_argument_with_a_nul_works_and_keeps_the_transaction(
        app: Celery, caller: psycopg.Connection, pg: psycopg.Connection, broker_url: str,
        kind: str) -> None:
    task = app.tasks["t.echo"]
    if kind == "enqueue":
        pgbroker.enqueue(caller, task, ("a\x00b",))
    elif kind == "enqueue_many":  # three of a kind: made from one template
        pgbroker.enqueue_many(caller, [(task, ("a\x00b",)), (task, ("plain",)),
                                       (task, (SURROGATE,))])
    else:
        with pgbroker.transaction(caller):
            task.delay("a\x00b")
    still_usable(caller)
    caller.commit()
    assert jobs(pg)[0]["state"] == "pending"
    assert deliver_one(broker_url).headers["argsrepr"] == saferepr(("a\x00b",))


# -- 5. refused with the limit named ---------------------------------------------------------------

@pytest.mark.parametrize("field", ["content_type", "content_encoding"])
def test_a_nul_in_content_type_or_encoding_is_refused_not_cut(
        broker_url: str, pg: psycopg.Connection, field: str) -> None:
    options = {"content_type": "application/json", "content_encoding": "utf-8"}
    options[field] = options[field] + "\x00; evil"
    with connect(broker_url) as conn, pytest.raises(MessageError, match=field.replace("_", " ")):
        kombu.Producer(conn.default_channel).publish(b'{"n": 1}', routing_key="q", **options)
    assert jobs(pg) == []


def test_a_queue_name_of_1000_four_byte_characters_is_refused_in_bytes(
        app: Celery, caller: psycopg.Connection, pg: psycopg.Connection) -> None:
    name = "🚀" * 1000  # 1,000 characters, 4,000 bytes: PostgreSQL's btree limit is in bytes
    with pytest.raises(MessageError, match=r"4000 bytes.*limit is 1024 bytes"):
        app.tasks["t.echo"].apply_async(("x",), queue=name)
    with pytest.raises(MessageError, match=r"4000 bytes.*limit is 1024 bytes"):
        pgbroker.enqueue(caller, app.tasks["t.echo"], ("x",), queue=name)
    still_usable(caller)
    assert jobs(pg) == []


def test_three_long_names_of_one_binding_are_refused_together(
        broker_url: str, pg: psycopg.Connection) -> None:
    name = "é" * 500  # 1,000 bytes each: 3,000 bytes in one index entry of the bindings
    with connect(broker_url) as conn, pytest.raises(MessageError, match="bytes"):
        kombu.Queue(name, kombu.Exchange(name, type="direct"), routing_key=name)(
            conn.default_channel).declare()
    assert pg.execute("SELECT count(*) FROM pgbroker.bindings").fetchone() == (0,)


@pytest.mark.parametrize("what", ["task id", "idempotency key"])
def test_a_task_id_or_idempotency_key_of_3000_characters_is_refused(
        app: Celery, caller: psycopg.Connection, pg: psycopg.Connection, what: str) -> None:
    long = "k" * 3000
    options = {"task_id": long} if what == "task id" else {
        "headers": {"idempotency_key": long}}
    with pytest.raises(MessageError, match=rf"{what} is 3000 bytes.*limit is 1024 bytes"):
        app.tasks["t.echo"].apply_async(("x",), **options)
    if what == "idempotency key":
        with pytest.raises(MessageError, match=rf"{what} is 3000 bytes.*limit is 1024 bytes"):
            pgbroker.enqueue(caller, app.tasks["t.echo"], ("x",), idempotency_key=long)
        still_usable(caller)
    assert jobs(pg) == []


@pytest.mark.parametrize("value", ["k\x00", SURROGATE], ids=["nul", "surrogate"])
def test_an_idempotency_key_or_task_id_postgresql_cannot_hold_is_refused(
        app: Celery, caller: psycopg.Connection, pg: psycopg.Connection, value: str) -> None:
    with pytest.raises(MessageError, match="idempotency key"):
        pgbroker.enqueue(caller, app.tasks["t.echo"], ("x",), idempotency_key=value)
    still_usable(caller)
    with pytest.raises(MessageError, match="task id"):
        app.tasks["t.echo"].apply_async(("x",), task_id=value)
    assert jobs(pg) == []


# -- 2. nesting, and the headers' size -------------------------------------------------------------

@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 3000])
def test_headers_nested_too_deep_are_refused_at_publish(
        app: Celery, caller: psycopg.Connection, pg: psycopg.Connection, depth: int) -> None:
    deep = nested(depth - 1)  # inside the headers dict: the headers are level 1
    with pytest.raises(MessageError, match=rf"nested deeper than {MAX_NESTING} levels"):
        app.tasks["t.echo"].apply_async(("x",), headers={"x-deep": deep})
    with pytest.raises(MessageError, match=rf"nested deeper than {MAX_NESTING} levels"):
        pgbroker.enqueue(caller, app.tasks["t.echo"], ("x",), headers={"x-deep": deep})
    still_usable(caller)
    assert jobs(pg) == []


def test_headers_nested_to_the_limit_are_delivered(app: Celery, broker_url: str) -> None:
    deep = nested(MAX_NESTING - 1)
    app.tasks["t.echo"].apply_async(("x",), headers={"x-deep": deep})
    assert deliver_one(broker_url).headers["x-deep"] == deep


def test_properties_nested_too_deep_are_refused(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn, pytest.raises(MessageError, match="properties"):
        kombu.Producer(conn.default_channel).publish(
            {"n": 1}, routing_key="q", serializer="json", x_custom=nested(500))
    assert jobs(pg) == []


@pytest.mark.parametrize("limit", [4096, None], ids=["4KiB", "default"])
def test_headers_over_max_header_size_are_refused(
        broker_url: str, pg: psycopg.Connection, limit: int | None) -> None:
    app = Celery("big_headers", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"max_header_size": limit} if limit else {}
    size = limit or 128 * 1024
    try:
        with pytest.raises(MessageError, match=rf"limit \(max_header_size\) is {size}"):
            app.send_task("t.echo", headers={"x-big": "h" * size})
        with pytest.raises(MessageError, match=r"max_header_size"):
            app.send_task("t.echo", headers={"x-big": "h" * 10_000_000})  # the 10 MB
        app.send_task("t.echo", headers={"x-big": "h" * (size // 2)})  # under it: accepted
    finally:
        app.close()
    assert [r["state"] for r in jobs(pg)] == ["pending"]


def test_a_header_that_is_not_json_is_refused_clearly(app: Celery, caller: psycopg.Connection,
                                                      pg: psycopg.Connection) -> None:
    with pytest.raises(MessageError, match="headers.*not JSON"):
        pgbroker.enqueue(caller, app.tasks["t.echo"], ("x",), headers={"x-nan": float("nan")})
    still_usable(caller)
    assert jobs(pg) == []


# -- 4. direct exchanges: nothing vanishes ---------------------------------------------------------

def _direct(conn: kombu.Connection, name: str = "orders", kind: str = "direct"
            ) -> kombu.Exchange:
    exchange = kombu.Exchange(name, type=kind)
    kombu.Queue("bound", exchange, routing_key="bound")(conn.default_channel).declare()
    return exchange


@pytest.mark.parametrize("kind", ["direct", "topic"])
def test_an_unroutable_publish_is_kept_dead_with_the_reason(
        broker_url: str, pg: psycopg.Connection, kind: str) -> None:
    """RabbitMQ drops it (mandatory=False) and the producer hears nothing -- kombu's own suite
    expects that -- so the publish raises nothing; but it is kept where an operator sees it: a
    dead letter of the queue pgbroker.unroutable that says why, with kombu's warning."""
    with connect(broker_url) as conn:
        exchange = _direct(conn, kind=kind)
        with pytest.warns(UndeliverableWarning):
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key="nobody", serializer="json",
                headers={"idempotency_key": "k"})
    [row] = jobs(pg)
    assert (row["queue"], row["state"], row["exchange"], row["routing_key"]) == (
        UNROUTABLE, "dead", "orders", "nobody")
    assert row["last_error"] == ("unroutable: no queue is bound to exchange 'orders' with "
                                 "routing key 'nobody'")
    assert json.loads(bytes(row["body"])) == {"n": 1}
    assert row["idempotency_key"] is None  # it must not swallow a later, routable publish


def test_an_unroutable_mandatory_publish_is_refused(broker_url: str,
                                                    pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        exchange = _direct(conn)
        with pytest.raises(MessageError, match="no queue is bound"):
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key="nobody", serializer="json",
                mandatory=True)
    assert jobs(pg) == []


def test_an_unroutable_transient_message_is_dropped_unless_mandatory(
        broker_url: str, pg: psycopg.Connection) -> None:
    """A remote-control reply to a client that left, as RabbitMQ drops it; with mandatory the
    producer asked to know, and is told."""
    with connect(broker_url) as conn:
        exchange = _direct(conn)
        producer = kombu.Producer(conn.default_channel)
        producer.publish({"n": 1}, exchange=exchange, routing_key="gone", serializer="json",
                         delivery_mode=1)
        with pytest.raises(MessageError, match="no queue is bound"):
            producer.publish({"n": 2}, exchange=exchange, routing_key="gone", serializer="json",
                             delivery_mode=1, mandatory=True)
    assert jobs(pg) == []


def test_an_unroutable_publish_in_a_transaction_block_is_kept_in_it(
        broker_url: str, db_url: str, pg: psycopg.Connection) -> None:
    with psycopg.connect(db_url) as caller, connect(broker_url) as conn:
        exchange = _direct(conn)
        with pgbroker.transaction(caller), pytest.warns(UndeliverableWarning):
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key="nobody", serializer="json")
        assert jobs(pg) == []  # the caller's transaction holds it ...
        caller.rollback()
    assert jobs(pg) == []  # ... and a rollback leaves nothing


def test_an_unroutable_publish_goes_to_the_deadletter_queue_when_one_is_set(
        broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url, deadletter_queue="unroutable") as conn:
        exchange = _direct(conn)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key="nobody", serializer="json")
        assert any(issubclass(w.category, UndeliverableWarning) for w in seen)
    [row] = jobs(pg)
    assert (row["queue"], row["state"]) == ("unroutable", "pending")


def test_the_deadletter_queue_does_not_hide_a_binding_made_by_another_process(
        broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as other:
        _direct(other)  # bound here, in another connection (another process's binding)
    with connect(broker_url, deadletter_queue="unroutable") as conn:
        kombu.Producer(conn.default_channel).publish(
            {"n": 1}, exchange="orders", routing_key="bound", serializer="json")
    assert [r["queue"] for r in jobs(pg)] == ["bound"]


@pytest.mark.parametrize("key", ["a\x00b", "k" * 10_000], ids=["nul", "10000"])
@pytest.mark.parametrize("kind", ["direct", "topic"])
def test_a_routing_key_no_name_can_match_is_refused_at_publish(
        broker_url: str, pg: psycopg.Connection, key: str, kind: str) -> None:
    with connect(broker_url) as conn:
        exchange = kombu.Exchange("ex", type=kind)
        kombu.Queue("all", exchange, routing_key="all")(conn.default_channel).declare()
        with pytest.raises(MessageError, match="routing key"):
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key=key, serializer="json")
    assert jobs(pg) == []


# -- risks: require_idempotency_key, the schema name -----------------------------------------------

@pytest.mark.parametrize("retries", [1, "x"])
def test_a_retries_header_does_not_skip_require_idempotency_key(
        app: Celery, pg: psycopg.Connection, retries: Any) -> None:
    with pytest.raises((IdempotencyKeyRequired, MessageError)):
        app.send_task("t.pay", args=(1,), headers={"retries": retries})
    assert jobs(pg) == []


def test_a_retries_header_that_is_not_a_count_is_refused(app: Celery,
                                                          pg: psycopg.Connection) -> None:
    with pytest.raises(MessageError, match="retries"):
        app.send_task("t.echo", headers={"retries": "x"})
    assert jobs(pg) == []


def test_a_schema_name_with_a_final_newline_is_refused(db_url: str,
                                                        pg: psycopg.Connection) -> None:
    with pytest.raises(ConfigurationError):
        pgbroker.Settings(schema="name\n")
    done = subprocess.run([sys.executable, "-m", "pgbroker", "migrate", "--database-url", db_url,
                           "--schema", "name\n"], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, check=False)
    assert done.returncode != 0 and "not a valid pgbroker schema name" in done.stderr
    assert pg.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'name%%'"
                      ).fetchone() == (0,)


def test_a_task_name_with_a_nul_is_refused(
        app: Celery, pg: psycopg.Connection) -> None:
    with pytest.raises(MessageError, match="task name"):
        app.send_task("t.\x00echo")
    assert jobs(pg) == []


def test_uuid_task_ids_still_publish(app: Celery, pg: psycopg.Connection) -> None:
    task_id = str(uuid.uuid4())
    app.tasks["t.echo"].apply_async(("x",), task_id=task_id)
    assert [r["task_id"] for r in jobs(pg)] == [task_id]


# -- 3. the sweeper and the broker's statements do not wait behind others' locks -------------------

def test_the_sweeper_does_not_wait_behind_row_locks(db_url: str, pg: psycopg.Connection) -> None:
    """Rows of each kind a sweep changes, each locked by a transaction left open: one pass
    still ends (it skips them), and the next pass after the locks go does the work."""
    store = store_for(db_url, retention=1)
    try:
        with connect("pgbroker+" + db_url) as conn:
            publish(conn, {"n": 1}, "done")
            kombu.Queue("idle", expires=1)(conn.default_channel).declare()  # x-expires 1 s
        gone = uuid.uuid4()
        pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, heartbeat_at)"
                   " VALUES (%s, 'h', 1, now() - interval '1 hour')", (gone,))
        pg.execute("UPDATE pgbroker.jobs SET state = 'completed', updated_at = now() - interval"
                   " '1 hour' WHERE queue = 'done'")
        pg.execute("UPDATE pgbroker.queues SET last_used_at = now() - interval '1 hour'")
        pg.execute("INSERT INTO pgbroker.broadcasts (id, exchange, body, created_at)"
                   " VALUES (%s, 'x', '', now() - interval '1 hour')", (uuid.uuid4(),))
        with psycopg.connect(db_url) as locker:
            for table in ("jobs", "queues", "consumers", "broadcasts"):
                locker.execute(f"SELECT 1 FROM pgbroker.{table} FOR UPDATE")
            done = threading.Event()
            thread = threading.Thread(target=lambda: (Sweeper(store).run_once(), done.set()),
                                      daemon=True)
            thread.start()
            thread.join(15)
            finished = done.is_set()
            locker.rollback()
        thread.join(30)
        assert finished, "a sweep waited for another session's row locks"
        result = Sweeper(store).run_once()
        assert (result.pruned, result.consumers, result.queues, result.broadcasts) == (1, 1, 1, 1)
    finally:
        store.close()


# -- risks: the migration lock, queues that pile up ------------------------------------------------

def test_a_held_migration_lock_fails_the_migration_with_who_holds_it(
        db_url: str, pg: psycopg.Connection) -> None:
    """Any role that can connect can take the advisory lock and keep it: migrating waits for it
    no longer than its lock timeout, and says who holds it."""
    pg.execute("SELECT pg_advisory_lock(hashtext('pgbroker.migrate.fresh'))")
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            pgbroker.migrate(db_url, "fresh", lock_timeout=1)
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(15)
    pg.execute("SELECT pg_advisory_unlock_all()")
    thread.join(15)
    [error] = outcome
    assert isinstance(error, SchemaError), repr(error)
    pid = pg.execute("SELECT pg_backend_pid()").fetchone()[0]
    assert f"held by pid {pid}" in str(error) and "more than 1 s" in str(error), str(error)
    assert pg.execute("SELECT to_regnamespace('fresh')").fetchone() == (None,)
    assert pgbroker.migrate(db_url, "fresh", lock_timeout=1)  # free again: it migrates


def test_queues_prune_deletes_the_queues_nobody_uses_and_keeps_the_others(
        broker_url: str, db_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        channel = conn.default_channel
        for i in range(1000):  # a client that makes up a queue name per request
            name = f"reply-{i}"
            kombu.Queue(name, kombu.Exchange(name, type="direct"), routing_key=name)(
                channel).declare()
        for name in ("has-jobs", "has-dead", "paused", "consumed"):
            kombu.Queue(name, kombu.Exchange("kept", type="direct"), routing_key=name)(
                channel).declare()
        publish(conn, {"n": 1}, "has-jobs")
        publish(conn, {"n": 2}, "has-dead")
        pg.execute("UPDATE pgbroker.jobs SET state = 'dead' WHERE queue = 'has-dead'")
        pg.execute("UPDATE pgbroker.queues SET paused = true WHERE name = 'paused'")
        Collector(conn, ["consumed"])  # a living consumer (its lease lists the queue)
        counts_before = [pg.execute(f"SELECT count(*) FROM pgbroker.{t}").fetchone()[0]
                         for t in ("queues", "exchanges", "bindings")]
        done = subprocess.run([sys.executable, "-m", "pgbroker", "queues", "prune", "--idle",
                               "0", "--database-url", db_url], capture_output=True, text=True,
                              timeout=120, cwd=REPO_ROOT, check=False)
        assert done.returncode == 0, done.stderr
        assert "deleted 1000 unused queue(s)" in done.stdout, done.stdout
    assert counts_before == [1004, 1001, 1004]
    assert sorted(r[0] for r in pg.execute("SELECT name FROM pgbroker.queues")) == [
        "consumed", "has-dead", "has-jobs", "paused"]
    assert pg.execute("SELECT name FROM pgbroker.exchanges").fetchall() == [("kept",)]
    assert pg.execute("SELECT count(*) FROM pgbroker.bindings").fetchone() == (4,)
    [(action, detail)] = pg.execute("SELECT action, detail FROM pgbroker.audit").fetchall()
    assert action == "queue.prune" and detail["queues"] == 1000
