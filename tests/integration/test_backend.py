"""The pgbroker result backend against a real PostgreSQL, without a worker.

Worker-driven behaviour (``.get()`` of real tasks, groups and chords of 100) is in
``tests/e2e/test_results_worker.py``. Here: URL resolution, storage rules, expiry and clean-up,
the chord counter's exactly-once claim (header tasks simulated by calling the backend as a worker
does, including duplicates and concurrent parts), NOTIFY wake-ups, reconnects, fork, bad input.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery, states
from celery.app.backends import by_url
from celery.app.task import Context
from celery.beat import Scheduler
from celery.result import GroupResult

from pgbroker._model.text import unescape, unescape_json
from pgbroker.backend import DatabaseBackend
from pgbroker.errors import ConfigurationError, JobDead, SchemaError
from tests.apps import results_app
from tests.support.db import add_job
from tests.support.processes import wait_for

BODY = results_app.NAME + "collect"  # the chord body of these tests (never run here)


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    with results_app.producer(broker_url) as app:
        yield app


@pytest.fixture
def backend(app: Celery) -> DatabaseBackend:
    return app.backend


@pytest.fixture
def other_backend(broker_url: str) -> Iterator[DatabaseBackend]:
    """A second backend on the same database: another process's connection."""
    with results_app.producer(broker_url) as app:
        yield app.backend


def store(backend: DatabaseBackend, task_id: str, value: Any = 1, state: str = states.SUCCESS,
          **request: Any) -> None:
    backend.store_result(task_id, value, state, request=Context(id=task_id, **request))


# -- configuration -------------------------------------------------------------------------------

def test_urls_select_the_backend_through_the_entry_point(db_url: str) -> None:
    rest = db_url.split("://", 1)[1]
    for url, passed in ((f"pgbroker://{rest}", f"pgbroker://{rest}"),
                        (f"pgbroker+postgresql://{rest}", f"postgresql://{rest}"),
                        (f"pgbroker.backend:DatabaseBackend+postgresql://{rest}",
                         f"postgresql://{rest}")):
        assert by_url(url) == (DatabaseBackend, passed)


def test_bare_alias_uses_the_broker_database(broker_url: str, pg: psycopg.Connection) -> None:
    app = Celery("x", broker=broker_url, backend="pgbroker", set_as_current=False)
    store(app.backend, "via-broker-url")
    app.backend.close()
    assert pg.execute("SELECT task_id FROM pgbroker.results").fetchall() == [("via-broker-url",)]


def backend_of(broker_url: str, **conf: Any) -> DatabaseBackend:
    """The backend of a producer app with ``conf`` (for configurations under test)."""
    return results_app.make_app(broker_url, **conf).backend


def test_unknown_and_bad_options_are_refused(broker_url: str) -> None:
    for options, error in (({"pol_interval": 1}, "did you mean 'poll_interval'"),
                           ({"result_keyprefix": "x"}, "unknown pgbroker transport option"),
                           ({"schema": "Bad-Name"}, "not a valid pgbroker schema"),
                           ({"prune_batch_size": 0}, "prune_batch_size"),
                           ({"poll_interval": "soon"}, "poll_interval")):
        with pytest.raises(ConfigurationError, match=error):
            backend_of(broker_url, result_backend_transport_options=options)
    app = Celery("x", broker="memory://", backend="pgbroker", set_as_current=False)
    with pytest.raises(ConfigurationError, match="needs a database URL"):
        app.backend  # noqa: B018


def test_schema_follows_the_broker_option_and_auto_migrate_off_refuses_a_missing_schema(
        broker_url: str, pg: psycopg.Connection) -> None:
    other = backend_of(broker_url, broker_transport_options={"schema": "other"})
    store(other, "t-other")
    assert pg.execute("SELECT count(*) FROM other.results").fetchone()[0] == 1
    other.close()

    absent = backend_of(broker_url, result_backend_transport_options={"schema": "absent",
                                                                      "auto_migrate": False})
    with pytest.raises(SchemaError, match="'absent' does not exist"):
        store(absent, "t-absent")
    assert pg.execute("SELECT to_regclass('absent.results')").fetchone()[0] is None


# -- storing and reading -------------------------------------------------------------------------

def test_round_trip_and_columns(backend: DatabaseBackend, pg: psycopg.Connection) -> None:
    store(backend, "t1", {"total": 4, "items": ["a"]}, task="shop.total", args=[1, 2],
          kwargs={"k": "v"}, hostname="w1@host", retries=2,
          delivery_info={"routing_key": "orders"})
    meta = backend.get_task_meta("t1", cache=False)
    assert meta["status"] == "SUCCESS" and meta["result"] == {"total": 4, "items": ["a"]}
    row = pg.execute("SELECT status, result, name, args, kwargs, worker, retries, queue, "
                     "date_done IS NOT NULL, expires_at > now() FROM pgbroker.results").fetchone()
    assert row == ("SUCCESS", {"total": 4, "items": ["a"]}, "shop.total", [1, 2], {"k": "v"},
                   "w1@host", 2, "orders", True, True)


def test_a_success_is_never_overwritten(backend: DatabaseBackend) -> None:
    store(backend, "t1", 1)
    store(backend, "t1", None, states.STARTED)  # a redelivered run starting again
    store(backend, "t1", ValueError("late"), states.FAILURE)
    assert backend.get_task_meta("t1", cache=False)["result"] == 1
    store(backend, "t2", None, states.STARTED)
    store(backend, "t2", 2)
    assert backend.get_task_meta("t2", cache=False)["status"] == "SUCCESS"


SURROGATE = b"caf\xe9".decode("utf-8", "surrogateescape")  # os.listdir's name for b"caf\xe9"


def test_a_dead_job_without_a_result_reads_as_its_failure(app: Celery, backend: DatabaseBackend,
                                                         pg: psycopg.Connection) -> None:
    """Issue 27, item 2: a task id with no stored result whose newest job is dead reads as
    FAILURE (JobDead, with the job's reason), never PENDING for ever; a stored result, or a
    newer row of the id that may still run (a retry), wins."""
    reason = "the task succeeded but its result could not be stored: 53100 disk full"
    add_job(pg, "dead", task_id="gone", last_error=reason)
    add_job(pg, "dead", task_id="retried", retries=0, last_error="boom")
    add_job(pg, "pending", task_id="retried", retries=1)
    add_job(pg, "dead", task_id="stored", last_error="late")
    store(backend, "stored", 7)
    gone = app.AsyncResult("gone")
    assert gone.state == states.FAILURE
    assert isinstance(gone.result, JobDead) and str(gone.result) == reason
    assert app.AsyncResult("retried").state == states.PENDING
    assert app.AsyncResult("stored").get(timeout=1) == 7
    keys = [backend.get_key_for_task(t) for t in ("gone", "retried", "stored", "nothing")]
    found = [None if p is None else backend.decode_result(p)["status"]
             for p in backend.mget(keys)]
    assert found == [states.FAILURE, None, states.SUCCESS, None]


def test_values_jsonb_cannot_hold_are_kept_in_the_payload(backend: DatabaseBackend,
                                                          pg: psycopg.Connection) -> None:
    store(backend, "nul", "a\x00b")
    store(backend, "nan", float("inf"))
    assert backend.get_task_meta("nul", cache=False)["result"] == "a\x00b"
    assert backend.get_task_meta("nan", cache=False)["result"] == float("inf")
    assert pg.execute("SELECT task_id FROM pgbroker.results WHERE result IS NULL"
                      ).fetchall() == [("nan",)]  # no JSON; the NUL's copy is escaped (below)


@pytest.mark.parametrize("text", ["a\x00b", SURROGATE], ids=["nul", "surrogate"])
def test_text_postgresql_cannot_hold_is_stored_and_read_back_exactly(
        backend: DatabaseBackend, pg: psycopg.Connection, text: str) -> None:
    """A result, and the failure of a task whose error has a NUL or a lone surrogate (a file
    name from os.listdir): stored, read back as it was, queryable escaped (pgbroker._model.text)."""
    store(backend, "ok", {text: [text]})
    backend.store_result("failed", ValueError(text), states.FAILURE,
                         traceback=f"Traceback {text}", request=Context(id="failed"))
    assert backend.get_task_meta("ok", cache=False)["result"] == {text: [text]}
    failed = backend.get_task_meta("failed", cache=False)
    assert (failed["status"], str(failed["result"])) == ("FAILURE", text)
    rows = dict(pg.execute("SELECT task_id, result FROM pgbroker.results").fetchall())
    assert unescape_json(rows["ok"]) == {text: [text]}
    assert unescape(pg.execute("SELECT traceback FROM pgbroker.results WHERE task_id = "
                               "'failed'").fetchone()[0]) == f"Traceback {text}"


def test_compressed_results(broker_url: str) -> None:
    zipped = backend_of(broker_url, result_compression="gzip")
    store(zipped, "z", "x" * 10_000)
    assert zipped.get_task_meta("z", cache=False)["result"] == "x" * 10_000
    zipped.close()


def test_bad_keys_and_ids_are_refused(backend: DatabaseBackend) -> None:
    with pytest.raises(ValueError, match="NUL"):
        store(backend, "bad\x00id")
    with pytest.raises(ValueError, match="over 1024 bytes"):
        store(backend, "i" * 3000)
    with pytest.raises(ValueError, match="not a task, group or chord key"):
        backend.get("something-else")
    with pytest.raises(ValueError, match="only chord counters"):
        backend.incr(backend.get_key_for_task("t1"))


def test_forget_and_groups(app: Celery, backend: DatabaseBackend) -> None:
    store(backend, "a")
    store(backend, "b")
    app.AsyncResult("a").forget()
    assert backend.get_task_meta("a", cache=False)["status"] == "PENDING"
    saved = GroupResult("g1", [app.AsyncResult("a"), app.AsyncResult("b")], app=app)
    saved.save(backend=backend)
    assert [r.id for r in GroupResult.restore("g1", backend=backend, app=app).results] == [
        "a", "b"]
    saved.delete(backend=backend)
    assert GroupResult.restore("g1", backend=backend, app=app) is None


# -- expiry --------------------------------------------------------------------------------------

def test_expired_results_are_invisible_and_cleaned_up_in_batches(
        broker_url: str, pg: psycopg.Connection) -> None:
    app = results_app.make_app(broker_url, result_expires=3600, result_failure_expires=60,
                               result_backend_transport_options={"prune_batch_size": 2})
    backend = app.backend
    for i in range(5):
        store(backend, f"old{i}")
    store(backend, "fresh")
    store(backend, "failed", ValueError("x"), states.FAILURE)
    GroupResult("g-old", [app.AsyncResult("old0")], app=app).save(backend=backend)
    backend.set_chord_size("c-old", 3)
    pg.execute("UPDATE pgbroker.results SET expires_at = now() - interval '1 second' "
               "WHERE task_id LIKE 'old%'")
    pg.execute("UPDATE pgbroker.result_groups SET expires_at = now() - interval '1 second'")
    pg.execute("UPDATE pgbroker.result_chords SET expires_at = now() - interval '1 second'")
    # result_failure_expires applies to failures only
    ttl = pg.execute("SELECT task_id, round(extract(epoch FROM expires_at - now())) "
                     "FROM pgbroker.results WHERE task_id IN ('fresh', 'failed') "
                     "ORDER BY task_id").fetchall()
    assert ttl == [("failed", 60), ("fresh", 3600)]
    # expired: gone for readers at once, before any clean-up
    assert backend.get_task_meta("old0", cache=False)["status"] == "PENDING"
    assert backend.cleanup() == 5 + 1 + 1  # results (3 batches of 2), the group, the chord
    assert {r[0] for r in pg.execute("SELECT task_id FROM pgbroker.results")} == {
        "fresh", "failed"}
    assert pg.execute("SELECT count(*) FROM pgbroker.result_groups").fetchone()[0] == 0
    # the clock moved past every expiry: everything goes
    assert backend.cleanup(now=datetime.now(timezone.utc) + timedelta(hours=2)) == 2
    backend.close()


def test_beat_schedules_backend_cleanup_which_cleans(app: Celery, backend: DatabaseBackend,
                                                     pg: psycopg.Connection) -> None:
    scheduler = Scheduler(app=app, lazy=True)
    scheduler.install_default_entries(scheduler.data)
    assert scheduler.schedule["celery.backend_cleanup"].task == "celery.backend_cleanup"
    store(backend, "old")
    pg.execute("UPDATE pgbroker.results SET expires_at = now() - interval '1 second'")
    app.tasks["celery.backend_cleanup"]()  # what the beat entry runs, in a worker
    assert pg.execute("SELECT count(*) FROM pgbroker.results").fetchone()[0] == 0


def test_no_expiry_when_result_expires_is_off(broker_url: str, pg: psycopg.Connection) -> None:
    forever = backend_of(broker_url, result_expires=None)
    store(forever, "kept")
    assert pg.execute("SELECT expires_at FROM pgbroker.results").fetchone()[0] is None
    assert forever.cleanup(now=datetime.now(timezone.utc) + timedelta(days=3650)) == 0
    forever.close()


# -- chords --------------------------------------------------------------------------------------

def start_chord(app: Celery, size: int, set_size: bool = True) -> tuple[str, list[str], dict]:
    """What ``chord.run`` does before the header runs: save the header group, set its size.
    Returns (group id, header task ids, the request's ``chord`` field)."""
    gid = str(uuid.uuid4())
    ids = [str(uuid.uuid4()) for _ in range(size)]
    body = app.signature(BODY, options={"task_id": str(uuid.uuid4())})
    app.backend.apply_chord((gid, [app.AsyncResult(i) for i in ids]), body)
    if set_size:
        app.backend.set_chord_size(gid, size)
    return gid, ids, dict(body)


def finish_part(backend: DatabaseBackend, gid: str, task_id: str, index: int,
                chord: dict, value: Any = None) -> None:
    """What a worker does when a header task returns: store the result, count the part."""
    request = Context(id=task_id, group=gid, group_index=index, chord=chord)
    backend.store_result(task_id, index if value is None else value, states.SUCCESS,
                         request=request)
    backend.on_chord_part_return(request, states.SUCCESS, value)


def callbacks(pg: psycopg.Connection) -> list[tuple[Any, ...]]:
    return pg.execute("SELECT task_id, body FROM pgbroker.jobs WHERE task = %s",
                      (BODY,)).fetchall()


def test_chord_fires_once_in_order_and_ignores_duplicates(
        app: Celery, backend: DatabaseBackend, pg: psycopg.Connection) -> None:
    gid, ids, chord = start_chord(app, 3)
    finish_part(backend, gid, ids[2], 2, chord)
    finish_part(backend, gid, ids[2], 2, chord)  # the same task run twice (redelivery)
    finish_part(backend, gid, ids[0], 0, chord)
    assert callbacks(pg) == []  # two distinct parts of three: not yet
    finish_part(backend, gid, ids[1], 1, chord)
    [(task_id, message)] = callbacks(pg)
    assert task_id == chord["options"]["task_id"]
    assert json.loads(bytes(message))[0] == [[0, 1, 2]]  # header results, in header order
    # late duplicates after the dispatch change nothing
    finish_part(backend, gid, ids[0], 0, chord)
    assert len(callbacks(pg)) == 1
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task = 'celery.chord_unlock'"
                      ).fetchone()[0] == 0


def test_chord_size_from_the_saved_header_when_celery_does_not_tell(
        app: Celery, backend: DatabaseBackend, pg: psycopg.Connection) -> None:
    gid, ids, chord = start_chord(app, 2, set_size=False)
    finish_part(backend, gid, ids[0], 0, chord)
    assert callbacks(pg) == []
    finish_part(backend, gid, ids[1], 1, chord)
    assert len(callbacks(pg)) == 1


def test_concurrent_parts_claim_the_callback_exactly_once(
        broker_url: str, app: Celery, pg: psycopg.Connection) -> None:
    gid, ids, chord = start_chord(app, 40)
    # 8 "worker processes", each with its own backend and connection, finishing parts at once,
    # every part twice (as after a lost worker)
    backends = [backend_of(broker_url) for _ in range(8)]
    barrier = threading.Barrier(len(backends))
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            barrier.wait()
            for index in range(n, len(ids) * 2, len(backends)):
                finish_part(backends[n], gid, ids[index % len(ids)], index % len(ids), chord)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for b in backends:
        b.close()
    assert errors == []
    assert len(callbacks(pg)) == 1
    assert pg.execute("SELECT done, size FROM pgbroker.result_chords").fetchone() == (40, 40)


def test_a_stale_claim_is_taken_over_and_the_publish_stays_single(
        app: Celery, backend: DatabaseBackend, pg: psycopg.Connection) -> None:
    """The worker that completed the chord died after publishing, before marking it: a
    redelivered header task re-claims once the claim is old, publishes again, and pgbroker's
    jobs table keeps one callback (same task id)."""
    gid, ids, chord = start_chord(app, 2)
    finish_part(backend, gid, ids[0], 0, chord)
    finish_part(backend, gid, ids[1], 1, chord)
    assert len(callbacks(pg)) == 1
    pg.execute("UPDATE pgbroker.result_chords SET dispatched_at = NULL, "
               "claimed_at = now() - interval '1 hour'")
    finish_part(backend, gid, ids[1], 1, chord)  # the redelivery
    assert len(callbacks(pg)) == 1
    assert pg.execute("SELECT dispatched_at IS NOT NULL FROM pgbroker.result_chords"
                      ).fetchone()[0]
    # while a claim is fresh, a duplicate does not take it over
    pg.execute("UPDATE pgbroker.result_chords SET dispatched_at = NULL, claimed_at = now()")
    pg.execute("DELETE FROM pgbroker.jobs")
    finish_part(backend, gid, ids[1], 1, chord)
    assert callbacks(pg) == []


def test_a_failed_header_task_fails_the_body(app: Celery, backend: DatabaseBackend,
                                             pg: psycopg.Connection) -> None:
    gid, ids, chord = start_chord(app, 2)
    finish_part(backend, gid, ids[0], 0, chord)
    request = Context(id=ids[1], group=gid, group_index=1, chord=chord)
    backend.mark_as_failure(ids[1], KeyError("gone"), request=request)  # counts the part too
    assert callbacks(pg) == []
    body = backend.get_task_meta(chord["options"]["task_id"], cache=False)
    assert body["status"] == "FAILURE" and "gone" in str(body["result"])


# -- waiting -------------------------------------------------------------------------------------

def test_get_is_woken_by_notify(app: Celery, backend: DatabaseBackend,
                                other_backend: DatabaseBackend) -> None:
    """The waiters' safety re-read is an hour away (fixture): only NOTIFY can wake them."""
    timer = threading.Timer(0.5, lambda: store(other_backend, "later", 42))
    timer.start()
    try:
        started = time.monotonic()
        assert app.AsyncResult("later").get(timeout=20) == 42
        print(f"\n[figure] get() woken {time.monotonic() - started - 0.5:.3f} s after the store")
    finally:
        timer.join()
    store(backend, "already")  # stored before get(): read at once, no wait
    assert app.AsyncResult("already").get(timeout=5) == 1


def test_get_survives_lost_connections(app: Celery, backend: DatabaseBackend,
                                       other_backend: DatabaseBackend,
                                       pg: psycopg.Connection) -> None:
    def stored_later(task_id: str, value: int) -> int:
        timer = threading.Timer(0.3, lambda: store(other_backend, task_id, value))
        timer.start()
        try:
            return app.AsyncResult(task_id).get(timeout=20)
        finally:
            timer.join()

    assert stored_later("first", 1) == 1  # the waiter now holds a LISTEN connection
    # kill every session of both backends (statements and LISTEN), as a database restart would
    killed = pg.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name LIKE 'pgbroker results%%' "
                        "AND datname = current_database()").fetchone()[0]
    assert killed == 3
    store(backend, "second")  # the broken connection is replaced, the statement sent again
    assert stored_later("third", 3) == 3  # a new LISTEN, and a re-read after it
    assert app.AsyncResult("second").get(timeout=5) == 1


def test_group_get_and_a_group_member_stored_later(app: Celery, backend: DatabaseBackend,
                                                   other_backend: DatabaseBackend) -> None:
    for i in range(50):
        store(backend, f"m{i}", i)
    timer = threading.Timer(0.3, lambda: store(other_backend, "m50", 50))
    timer.start()
    try:
        group = GroupResult("g", [app.AsyncResult(f"m{i}") for i in range(51)], app=app)
        assert group.get(timeout=20) == list(range(51))
    finally:
        timer.join()


def test_a_forked_child_opens_its_own_connections(app: Celery, backend: DatabaseBackend,
                                                  other_backend: DatabaseBackend) -> None:
    # the parent waits once first, so that it holds both connections (statements and LISTEN)
    timer = threading.Timer(0.3, lambda: store(other_backend, "before-fork", 1))
    timer.start()
    assert app.AsyncResult("before-fork").get(timeout=20) == 1
    timer.join()
    pid = os.fork()
    if pid == 0:  # the child: store and wait through the inherited objects, then leave at once
        code = 1
        try:
            store(backend, "child", 7)
            code = 0 if app.AsyncResult("after-fork").get(timeout=20) == 2 else 2
        finally:
            os._exit(code)
    # the child has stored through the inherited objects and goes on to wait (not a timed
    # assertion: the child finds the result either way)
    wait_for(lambda: other_backend.get_task_meta("child", cache=False)["result"] == 7, 20,
             interval=0.05, message="the child's result")
    store(other_backend, "after-fork", 2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # the parent's connections were neither closed nor used by the child
    assert backend.get_task_meta("child", cache=False)["result"] == 7
    timer = threading.Timer(0.3, lambda: store(other_backend, "parent-again", 3))
    timer.start()
    assert app.AsyncResult("parent-again").get(timeout=20) == 3
    timer.join()
