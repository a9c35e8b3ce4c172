"""``pgbroker.testing``, the helpers an application's tests use: what is enqueued (also in a
transaction still open), and running it in the test's process."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery

import pgbroker
from pgbroker import testing

ran: list[str] = []


class Boom(Exception):
    """What ``fail`` raises."""


# Plain functions, registered on each test's app (the same callable under the same name).
def greet(name: str, punctuation: str = "!") -> str:
    ran.append(name)
    return f"hello {name}{punctuation}"


def fail() -> None:
    raise Boom("no")


def fan_out(count: int) -> int:
    """Enqueues ``count`` greetings: run_enqueued runs them as well."""
    for n in range(count):
        fan_out.app.send_task("t.greet", (f"child {n}",))  # type: ignore[attr-defined]
    return count


def forever() -> None:
    forever.app.send_task("t.forever")  # type: ignore[attr-defined]


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = Celery("testing", broker=broker_url, set_as_current=False)
    for function in (greet, fail, fan_out, forever):
        app.task(name=f"t.{function.__name__}")(function)
        function.app = app  # type: ignore[attr-defined]
    ran.clear()
    try:
        yield app
    finally:
        app.close()


def test_jobs_of_an_open_transaction_are_seen_on_its_connection(app: Celery,
                                                               db_url: str) -> None:
    with psycopg.connect(db_url) as conn:  # a transaction, not committed
        pgbroker.enqueue(conn, "t.greet", ("ada",), {"punctuation": "?"}, app=app)
        [job] = testing.assert_enqueued(conn, "t.greet", args=["ada"],
                                        kwargs={"punctuation": "?"}, app=app)
        assert job.queue == "celery" and job.state == "pending"
        testing.refute_enqueued(None, app=app)  # another session: nothing committed
        with pytest.raises(AssertionError, match=r"found 0; enqueued:\n  t.greet args=\['ada'\]"):
            testing.assert_enqueued(conn, "t.greet", args=["bob"], app=app)
        with pytest.raises(AssertionError, match="expected no job of task 't.greet'"):
            testing.refute_enqueued(conn, app.tasks["t.greet"], app=app)
        conn.rollback()


def test_run_enqueued_runs_what_is_due_and_what_it_enqueues(app: Celery,
                                                             pg: psycopg.Connection) -> None:
    pgbroker.enqueue(pg, "t.fan_out", (2,), app=app)
    pgbroker.enqueue(pg, "t.greet", ("later",), countdown=3600, app=app)  # not due
    done = testing.run_enqueued(pg, app=app)
    assert [r.job.task for r in done] == ["t.fan_out", "t.greet", "t.greet"]
    assert ran == ["child 0", "child 1"] and done[1].result.get() == "hello child 0!"
    assert len(testing.enqueued(pg, "t.greet", app=app)) == 1  # the scheduled one waits
    assert len(testing.enqueued(pg, states=["completed"], app=app)) == 3


def test_a_failure_ends_dead_and_propagates_when_asked(app: Celery,
                                                       pg: psycopg.Connection) -> None:
    pgbroker.enqueue(pg, "t.fail", app=app)
    [failed] = testing.run_enqueued(pg, propagate=False, app=app)
    assert not failed.result.successful()
    [dead] = testing.enqueued(pg, states=["dead"], app=app)
    assert "Boom" in dead.last_error
    pgbroker.enqueue(pg, "t.fail", app=app)
    with pytest.raises(Boom):
        testing.run_enqueued(pg, app=app)


def test_a_task_that_enqueues_itself_stops_at_the_limit(app: Celery,
                                                        pg: psycopg.Connection) -> None:
    pgbroker.enqueue(pg, "t.forever", app=app)
    with pytest.raises(AssertionError, match="ran 5 jobs and more are due"):
        testing.run_enqueued(pg, limit=5, app=app)


def test_clear_enqueued_empties_the_queue(app: Celery, pg: psycopg.Connection) -> None:
    pgbroker.enqueue_many(pg, [("t.greet", ("a",)), ("t.greet", ("b",))], app=app)
    assert testing.clear_enqueued(app=app) == 2
    testing.refute_enqueued(pg, app=app)
