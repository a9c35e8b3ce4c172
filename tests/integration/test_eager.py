"""Celery's eager mode (``task_always_eager``, how many test suites run Celery) for pgbroker's
own enqueue: ``pgbroker.enqueue``, ``enqueue_many``, ``aenqueue`` and ``aenqueue_many`` run the
task at once, in the caller, as ``.delay()`` does, and write nothing -- but the message is still
checked."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery

import pgbroker
from pgbroker.errors import IdempotencyKeyRequired

ran: list[tuple[str, tuple[int, ...]]] = []


class Boom(Exception):
    """What ``fail`` raises."""


# Plain functions, registered on each test's app (the same callable under the same name, so
# Celery does not warn about duplicate task names across apps).
def add(x: int, y: int) -> int:
    ran.append(("add", (x, y)))
    return x + y


def pay(amount: int) -> None:
    ran.append(("pay", (amount,)))


def fail() -> None:
    raise Boom("failed")


@pytest.fixture
def eager(broker_url: str) -> Iterator[Celery]:
    """A pgbroker app on this test's database in eager mode, with tasks that record their runs."""
    app = Celery("eager", broker=broker_url, set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.broker_transport_options = {"require_idempotency_key": ["eager.pay"]}
    for function in (add, pay, fail):
        app.task(name=f"eager.{function.__name__}")(function)
    ran.clear()
    try:
        yield app
    finally:
        app.close()


def _jobs(pg: psycopg.Connection) -> int:
    return pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0]


def test_enqueue_runs_the_task_now_and_writes_nothing(eager: Celery, pg: psycopg.Connection,
                                                      db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        job = pgbroker.enqueue(conn, eager.tasks["eager.add"], (1, 2), app=eager)
        by_name = pgbroker.enqueue(conn, "eager.add", (3, 4), app=eager)
        eager.tasks["eager.add"].delay(5, 6)  # Celery's own eager path, for comparison
        conn.commit()
    assert isinstance(job, uuid.UUID) and isinstance(by_name, uuid.UUID)
    assert ran == [("add", (1, 2)), ("add", (3, 4)), ("add", (5, 6))]
    assert _jobs(pg) == 0
    pgbroker.enqueue(pg, "elsewhere.report", (1,), app=eager)  # as send_task: not eager
    assert _jobs(pg) == 1 and len(ran) == 3


def test_enqueue_many_runs_the_known_and_writes_the_rest(eager: Celery,
                                                         pg: psycopg.Connection) -> None:
    ids = pgbroker.enqueue_many(pg, [("eager.add", (1, 1)), ("elsewhere.report", (2,)),
                                     (eager.tasks["eager.add"], (3, 3))], app=eager)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert ran == [("add", (1, 1)), ("add", (3, 3))]
    [(written,)] = pg.execute("SELECT id FROM pgbroker.jobs").fetchall()
    assert written == ids[1]


def test_the_message_is_still_checked(eager: Celery, pg: psycopg.Connection) -> None:
    with pytest.raises(IdempotencyKeyRequired):
        pgbroker.enqueue(pg, "eager.pay", (10,), app=eager)
    with pytest.raises(IdempotencyKeyRequired):
        pgbroker.enqueue_many(pg, [("eager.pay", (10,))], app=eager)
    assert ran == []
    pgbroker.enqueue(pg, "eager.pay", (10,), idempotency_key="pay-1", app=eager)
    assert ran == [("pay", (10,))] and _jobs(pg) == 0


def test_exceptions_propagate_as_celery_says(eager: Celery, pg: psycopg.Connection) -> None:
    pgbroker.enqueue(pg, "eager.fail", app=eager)  # task_eager_propagates off: swallowed
    eager.conf.task_eager_propagates = True
    with pytest.raises(Boom):
        pgbroker.enqueue(pg, "eager.fail", app=eager)


def test_aenqueue_and_aenqueue_many_run_the_task_now(eager: Celery, pg: psycopg.Connection,
                                                      db_url: str) -> None:
    async def main() -> list[uuid.UUID]:
        async with await psycopg.AsyncConnection.connect(db_url) as conn:
            one = await pgbroker.aenqueue(conn, "eager.add", (7, 8), app=eager)
            return [one, *await pgbroker.aenqueue_many(conn, [("eager.add", (9, 9))], app=eager)]

    assert len(set(asyncio.run(main()))) == 2
    assert ran == [("add", (7, 8)), ("add", (9, 9))] and _jobs(pg) == 0
