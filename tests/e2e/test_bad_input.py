"""Bad input gets a clear error and loses nothing: hostile names, messages a worker must not or
cannot run, and broken configuration.

Each case either is refused at publish (nothing written) or ends ``dead`` with its reason while
the worker keeps running. The message cases share one real ``celery worker`` (a module-scoped
database and worker: starting one per case would cost seconds each); every case uses task ids
of its own and checks that the worker still runs a task afterwards.

Covered elsewhere (not repeated here): queue names with quotes, SQL, unicode, NUL bytes and
overlong names (tests/integration/test_transport.py ``test_queue_names_are_data_*``,
``test_invalid_queue_names_*``), an undecodable body and a malformed row with a real worker
(tests/e2e/test_worker.py), a dead port (tests/unit/test_transport_errors.py
``test_establish_connection_to_a_dead_port_fails_at_once``), a missing or newer schema through
kombu (tests/integration/test_migrate.py).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import kombu
import psycopg
import pytest
from celery import Celery

from pgbroker._pg.local_server import admin_url
from pgbroker.errors import DatabaseUnavailable, MessageError
from pgbroker.transport import MAX_NAME_LENGTH
from tests.support.throwaway import throwaway_server
from tests.support.databases import create_database, drop_database
from tests.apps import e2e_app as e2e
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import WorkerProcess, run_worker, wait_for
from tests.support.transport import Collector, connect, jobs
from tests.support.workers import job, wait_state

SECRET = "n0t-in-any-message"
_names = itertools.count(1)


# -- one database and one worker for the message cases ---------------------------------------------

@pytest.fixture(scope="module")
def shared_url(database_url: str, template_db: str) -> Iterator[str]:
    """A migrated database (postgresql://) shared by this module's worker cases."""
    name = f"pgbroker_test_bad_{os.getpid()}_{next(_names)}"
    create_database(database_url, name, template=template_db)
    try:
        url = admin_url(database_url, name)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(e2e.RUNS_DDL)
        yield url
    finally:
        drop_database(database_url, name)


@pytest.fixture(scope="module")
def shared_pg(shared_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(shared_url, autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def worker(shared_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One ``celery worker`` of tests.apps.e2e_app (accept_content: Celery's default, json only),
    with ``e2e.app`` publishing to the same database."""
    point_producer(e2e.app, "pgbroker+" + shared_url)
    proc = run_worker("tests.apps.e2e_app", "pgbroker+" + shared_url,
                      log_dir=tmp_path_factory.mktemp("bad-input-worker"))
    try:
        yield proc.wait_ready(60)
    finally:
        proc.stop()
        drop_pools(e2e.app)


def still_works(pg: psycopg.Connection, worker: WorkerProcess) -> None:
    """The worker is alive and runs the next task."""
    key = f"still-{uuid.uuid4()}"
    result = e2e.touch.delay(key)
    wait_for(lambda: job(pg, result.id)["state"] == "completed", 60, interval=0.1,
             message=f"the follow-up task {key}")
    assert worker.is_alive()


def publish_raw(pg_url: str, task_id: str, body: bytes, content_type: str,
                content_encoding: str = "binary", serializer_task: str = "tests.apps.e2e_app.touch"
                ) -> None:
    """A Celery-shaped message with an arbitrary body and content type, through kombu."""
    headers = {"task": serializer_task, "id": task_id, "lang": "py", "argsrepr": "()",
               "kwargsrepr": "{}", "retries": 0, "eta": None, "expires": None}
    with kombu.Connection("pgbroker+" + pg_url) as conn:
        kombu.Producer(conn.default_channel).publish(
            body, routing_key="celery", content_type=content_type,
            content_encoding=content_encoding, headers=headers, correlation_id=task_id)


# -- messages a worker must not or cannot run ------------------------------------------------------

def test_unknown_content_type_goes_dead_with_the_reason(
        worker: WorkerProcess, shared_url: str, shared_pg: psycopg.Connection) -> None:
    task_id = f"ctype-{uuid.uuid4()}"
    publish_raw(shared_url, task_id, b"\x00\x01 not for you", "application/x-made-up")
    dead = wait_state(shared_pg, task_id, "dead")
    assert "application/x-made-up" in dead["last_error"], dead["last_error"]
    assert dead["attempts"] == 1  # not retried in a loop
    still_works(shared_pg, worker)


class _Tripwire:
    """Unpickling this creates a file: proof that a pickle was (or was not) deserialised."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_pickle_is_refused_when_only_json_is_accepted_and_never_unpickled(
        worker: WorkerProcess, shared_url: str, shared_pg: psycopg.Connection,
        tmp_path: Path) -> None:
    tripwire = tmp_path / "unpickled"
    task_id = f"pickle-{uuid.uuid4()}"
    body = pickle.dumps(((_Tripwire(tripwire),), {}, {}))
    publish_raw(shared_url, task_id, body, "application/x-python-serialize")

    dead = wait_state(shared_pg, task_id, "dead")
    assert "application/x-python-serialize" in dead["last_error"], dead["last_error"]
    assert "ContentDisallowed" in dead["last_error"], dead["last_error"]
    assert not tripwire.exists(), "the worker unpickled a message"
    assert bytes(dead["body"]) == body  # kept as it came, for an operator to look at
    still_works(shared_pg, worker)


def test_celery_pickle_serializer_is_refused_by_the_worker(
        worker: WorkerProcess, shared_pg: psycopg.Connection) -> None:
    result = e2e.touch.apply_async(("pickled",), serializer="pickle")
    dead = wait_state(shared_pg, result.id, "dead")
    assert "pickle" in dead["last_error"] or "python-serialize" in dead["last_error"]
    assert not shared_pg.execute("SELECT count(*) FROM public.runs WHERE key = 'pickled'"
                                 ).fetchone()[0]
    still_works(shared_pg, worker)


def test_task_name_no_worker_knows_goes_dead(worker: WorkerProcess,
                                             shared_pg: psycopg.Connection) -> None:
    result = e2e.app.send_task("tests.apps.e2e_app.nobody_knows_me", args=("x",))
    dead = wait_state(shared_pg, result.id, "dead")
    assert dead["last_error"], dead  # which reason: see the test below
    assert dead["attempts"] == 1
    assert "nobody_knows_me" in worker.log()  # Celery says which name it did not know
    still_works(shared_pg, worker)


def test_task_name_no_worker_knows_is_named_in_last_error(
        worker: WorkerProcess, shared_pg: psycopg.Connection) -> None:
    result = e2e.app.send_task("tests.apps.e2e_app.also_unknown", args=("x",))
    wait_state(shared_pg, result.id, "dead")
    # Celery rejects the message first (dead, "rejected by the consumer") and only then sends
    # task_unknown, whose hook writes the reason: wait for that second write.
    wait_for(lambda: "also_unknown" in (job(shared_pg, result.id)["last_error"] or ""), 30,
             interval=0.1, message=lambda: f"the task's name in {job(shared_pg, result.id)}")


def test_wrong_argument_types_end_dead_with_the_type_error(
        worker: WorkerProcess, shared_pg: psycopg.Connection) -> None:
    result = e2e.add.delay("one", None)  # the right number of arguments, of the wrong types
    dead = wait_state(shared_pg, result.id, "dead")
    assert dead["last_error"].startswith("TypeError"), dead["last_error"]
    assert "Traceback" in dead["last_traceback"]
    still_works(shared_pg, worker)


def test_wrong_number_of_arguments_is_refused_at_publish(
        worker: WorkerProcess, shared_pg: psycopg.Connection) -> None:
    before = shared_pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0]
    with pytest.raises(TypeError):
        e2e.add.delay(1)  # Celery checks the signature before publishing
    assert shared_pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == before


@pytest.mark.parametrize("limit", [1024, None], ids=["1KiB", "default-16MiB"])
def test_payload_over_max_message_size_is_refused_at_publish(
        broker_url: str, pg: psycopg.Connection, limit: int | None) -> None:
    options = {"max_message_size": limit} if limit else {}
    app = Celery("big", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = options
    size = limit or 16 * 1024 * 1024
    try:
        with pytest.raises(MessageError, match=rf"limit \(max_message_size\) is {size}"):
            app.send_task("tests.apps.e2e_app.touch", args=("x" * size,))
        app.send_task("tests.apps.e2e_app.touch", args=("x" * (size // 2),))  # under it: accepted
    finally:
        app.close()
    assert [r["state"] for r in jobs(pg)] == ["pending"]


# -- hostile exchange and routing-key names --------------------------------------------------------

NAMES = {
    "quotes": "it's a \"quoted\" name",
    "sql": "x'); DROP TABLE pgbroker.jobs; --",
    "placeholders": "%(queue)s {schema} $1 %s",
    "unicode": "обмен-é-交换-🚀",
    "longest": "n" * (MAX_NAME_LENGTH - 1) + "é",
}


@pytest.mark.parametrize("kind", ["direct", "topic"])
@pytest.mark.parametrize("name", NAMES.values(), ids=NAMES.keys())
def test_exchange_and_routing_key_names_are_data(broker_url: str, pg: psycopg.Connection,
                                                 name: str, kind: str) -> None:
    """Stored as given, routed by exact match (or AMQP topic rules), never part of the SQL."""
    near_miss = name[:-1] + ("y" if name[-1] != "y" else "x")
    with connect(broker_url) as conn:
        exchange = kombu.Exchange(name, type=kind)
        queue = kombu.Queue("named", exchange, routing_key=name)
        queue(conn.default_channel).declare()
        producer = kombu.Producer(conn.default_channel)
        producer.publish({"to": "name"}, exchange=exchange, routing_key=name, serializer="json")
        producer.publish({"to": "near miss"}, exchange=exchange, routing_key=near_miss,
                         serializer="json")
        collector = Collector(conn, [queue], ack=True)
        collector.take(1)
        assert collector.nothing_for(0.3)
    assert collector.bodies == [{"to": "name"}]
    # the near miss matched no binding: unroutable, kept as a dead letter (AMQP drops it)
    [stored] = jobs(pg, "state <> 'dead'")
    assert [r["state"] for r in jobs(pg, "state = 'dead'")] == ["dead"]
    assert (stored["exchange"], stored["routing_key"]) == (name, name)
    assert pg.execute("SELECT name, type FROM pgbroker.exchanges").fetchall() == [(name, kind)]
    assert pg.execute("SELECT routing_key FROM pgbroker.bindings").fetchall() == [(name,)]


@pytest.mark.parametrize("bad", ["nul\x00byte", "e" * (MAX_NAME_LENGTH + 1)], ids=["nul", "1001"])
def test_bad_exchange_and_binding_names_are_refused(broker_url: str, pg: psycopg.Connection,
                                                    bad: str) -> None:
    with connect(broker_url) as conn:
        channel = conn.default_channel
        with pytest.raises(MessageError, match="exchange name"):
            kombu.Exchange(bad, type="direct")(channel).declare()
        with pytest.raises(MessageError, match="routing key name"):
            kombu.Queue("q", kombu.Exchange("ok", type="direct"), routing_key=bad)(
                channel).declare()
    assert pg.execute("SELECT count(*) FROM pgbroker.bindings").fetchone() == (0,)
    assert pg.execute("SELECT count(*) FROM pgbroker.exchanges WHERE name <> 'ok'"
                      ).fetchone() == (0,)


@pytest.mark.parametrize("kind", ["topic", "fanout"])
def test_nul_in_a_published_routing_key_is_refused_and_nothing_is_stored(
        broker_url: str, pg: psycopg.Connection, kind: str) -> None:
    with connect(broker_url) as conn:
        exchange = kombu.Exchange("catch-all", type=kind)
        kombu.Queue("all", exchange, routing_key="#")(conn.default_channel).declare()
        Collector(conn, ["all"])  # a live consumer, so that a fanout is written at all
        with pytest.raises((MessageError, psycopg.DataError), match="NUL"):
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key="a\x00b", serializer="json")
    assert jobs(pg) == []
    assert pg.execute("SELECT count(*) FROM pgbroker.broadcasts").fetchone() == (0,)


def test_nul_in_a_published_routing_key_is_a_message_error(broker_url: str) -> None:
    with connect(broker_url) as conn:
        exchange = kombu.Exchange("catch-all", type="topic")
        kombu.Queue("all", exchange, routing_key="#")(conn.default_channel).declare()
        with pytest.raises(MessageError, match="routing key"):
            kombu.Producer(conn.default_channel).publish(
                {"n": 1}, exchange=exchange, routing_key="a\x00b", serializer="json")


# -- broken configuration -------------------------------------------------------------------------

def _refusal(url: str, **options: Any) -> BaseException:
    """The error of connecting to ``url`` (which must fail), through kombu as Celery does."""
    conn = kombu.Connection(url, transport_options={"connect_timeout": 10, **options})
    try:
        with pytest.raises(Exception) as info:
            conn.transport.establish_connection()
        return info.value
    finally:
        conn.release()


@pytest.mark.parametrize(("part", "says"), [
    ("user", 'role "pgbroker_no_such_role" does not exist'),
    ("database", 'database "pgbroker_no_such_db" does not exist'),
])
def test_unknown_role_or_database_is_named_in_the_error(db_url: str, part: str,
                                                        says: str) -> None:
    host = db_url.split("@", 1)[1].split("/", 1)[0]
    user, dbname = "postgres", db_url.rsplit("/", 1)[1]
    if part == "user":
        user = "pgbroker_no_such_role"
    else:
        dbname = "pgbroker_no_such_db"
    error = _refusal(f"pgbroker://{user}:{SECRET}@{host}/{dbname}")
    assert isinstance(error, DatabaseUnavailable)
    assert says in str(error), str(error)
    assert SECRET not in str(error) and SECRET not in repr(error.__cause__ or "")


def test_wrong_password_says_authentication_failed_and_never_shows_it() -> None:
    with throwaway_server(password="the-right-one") as server:
        good = server.url().replace("the-right-one", quote(f"wrong {SECRET}", safe=""))
        error = _refusal("pgbroker+" + good)
        assert isinstance(error, DatabaseUnavailable)
        assert "password authentication failed" in str(error), str(error)
        assert SECRET not in str(error)
        assert SECRET not in str(error.__cause__)
        # the right password works (the server really checks it)
        with psycopg.connect(server.url(), connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.parametrize(("fault", "says"), [
    ("missing", "run `pgbroker migrate`"),
    ("newer", "upgrade pgbroker"),
])
def test_a_worker_on_a_missing_or_newer_schema_says_what_to_do(
        db_url: str, broker_url: str, pg: psycopg.Connection, fault: str, says: str) -> None:
    if fault == "missing":
        pg.execute("DROP SCHEMA pgbroker CASCADE")
    else:
        pg.execute("INSERT INTO pgbroker.migrations (version, name) VALUES (999, 'future')")
    worker = run_worker("tests.apps.e2e_app", broker_url, env={
        "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps({"auto_migrate": False})})
    wait_for(lambda: says in worker.log() or not worker.is_alive(), 60, interval=0.2,
             message=lambda: f"{says!r} in the worker's log:\n{worker.log()[-2000:]}")
    assert says in worker.log(), worker.log()[-2000:]
    assert worker.wait(30) != 0  # it stops, saying why, rather than retrying forever
    worker.stop()
    if fault == "missing":  # nothing was created behind the operator's back
        assert pg.execute("SELECT to_regnamespace('pgbroker')").fetchone() == (None,)
    else:
        assert pg.execute("SELECT max(version) FROM pgbroker.migrations").fetchone() == (999,)
