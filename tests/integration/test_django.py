"""Django: jobs enqueued on Django's own connection, inside ``transaction.atomic()``.

The project is ``tests/apps/django_project`` (settings, a Celery app, the app ``shop``); the
``django_db`` fixture (``tests/support/fixtures.py``) points its ``default`` connection at each
test's fresh database. The worker is ``celery -A tests.apps.django_project.celery``,
a real Django + Celery worker whose task reads the order through the ORM: it succeeds only if the
order's transaction committed before the job could run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

import pgbroker
from pgbroker.contrib import django as pgdjango
from tests.apps import results_app
from tests.support.processes import run_worker, wait_for

CONFIRM = "tests.apps.django_project.shop.tasks.confirm_order"


class Abort(Exception):
    """Raised inside atomic() to roll it back."""


@pytest.fixture
def client(broker_url: str, django_db: Any) -> Iterator[Celery]:
    """The producer: pgbroker broker and result backend on this test's database."""
    with results_app.producer(broker_url) as app:
        yield app


def _jobs(pg: psycopg.Connection) -> list[tuple[str, str]]:
    return pg.execute("SELECT task, task_id FROM pgbroker.jobs").fetchall()


def _enqueue_order(client: Celery, how: str, item: str) -> int:
    """In the caller's atomic(): create an order and enqueue its confirmation ``how``."""
    from tests.apps.django_project.shop.models import Order

    order = Order.objects.create(item=item)
    if how == "enqueue":
        pgdjango.enqueue(CONFIRM, (order.pk,), app=client)
    else:
        with pgdjango.transaction():
            client.send_task(CONFIRM, (order.pk,))
    return order.pk


@pytest.mark.parametrize("how", ["enqueue", "transaction"])
def test_rollback_leaves_no_job(client: Celery, pg: psycopg.Connection, how: str) -> None:
    from django.db import transaction

    from tests.apps.django_project.shop.models import Order

    with pytest.raises(Abort), transaction.atomic():
        _enqueue_order(client, how, "book")
        assert _jobs(pg) == []  # another session sees nothing before the commit
        raise Abort
    assert _jobs(pg) == []
    assert Order.objects.count() == 0


@pytest.mark.parametrize("how", ["enqueue", "transaction"])
def test_commit_runs_the_job_on_a_worker(client: Celery, pg: psycopg.Connection,
                                         broker_url: str, how: str) -> None:
    from django.db import transaction

    from tests.apps.django_project.shop.models import Order

    with transaction.atomic():
        order_id = _enqueue_order(client, how, "lamp")
        assert _jobs(pg) == []
    [(task, task_id)] = _jobs(pg)
    assert task == CONFIRM

    run_worker("tests.apps.django_project.celery", broker_url,
               env={"DJANGO_SETTINGS_MODULE": "tests.apps.django_project.settings"}).wait_ready(60)
    assert client.AsyncResult(task_id).get(timeout=30) == order_id
    assert Order.objects.get(pk=order_id).confirmed
    wait_for(lambda: pg.execute("SELECT state FROM pgbroker.jobs").fetchone()[0] == "completed",
             30, message="the job acked")


def test_nested_savepoint_rollback_keeps_the_outer_job(client: Celery,
                                                       pg: psycopg.Connection) -> None:
    from django.db import transaction

    with transaction.atomic():
        _enqueue_order(client, "enqueue", "kept")
        with pytest.raises(Abort), transaction.atomic():  # a SAVEPOINT
            _enqueue_order(client, "enqueue", "dropped")
            raise Abort
    assert len(_jobs(pg)) == 1


def test_outside_atomic_each_job_commits_at_once(client: Celery, pg: psycopg.Connection) -> None:
    _enqueue_order(client, "enqueue", "autocommit")
    assert len(_jobs(pg)) == 1


def test_refuses_what_is_not_postgresql_on_psycopg3(django_db: Any) -> None:
    with pytest.raises(TypeError, match="needs PostgreSQL.*sqlite"):
        pgdjango.connection("sqlite")
    with pytest.raises(TypeError, match="expected a Django database connection"):
        pgdjango.driver_connection(object())
    from django.db import connection

    raw = django_db.connection  # the psycopg 3 connection itself, whichever way it is named
    assert pgdjango.connection() is raw
    assert pgdjango.driver_connection(connection) is raw
    assert pgdjango.driver_connection(django_db) is raw
    assert isinstance(django_db.connection, psycopg.Connection)


def test_pgbroker_enqueue_accepts_django_connection(client: Celery,
                                                    pg: psycopg.Connection) -> None:
    from django.db import connection, transaction

    with transaction.atomic():
        pgbroker.enqueue(connection, CONFIRM, (1,), app=client)
        with pgbroker.transaction(connection):
            client.send_task(CONFIRM, (2,))
    assert len(_jobs(pg)) == 2
