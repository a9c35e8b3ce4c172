"""Django's own test cases over pgbroker, run by ``manage.py test`` (Django's runner, its test
database made by ``migrate``): ``tests/django_app/test_django_runner.py`` runs them with
``DJANGO_SETTINGS_MODULE=tests.apps.django_project.settings_atomic`` (the broker on Django's
database, ``PGBROKER_JOIN_ATOMIC = True``).

``TestCase`` wraps each test in a transaction it rolls back, so its jobs are seen on Django's
connection only (``pgbroker.testing``); ``TransactionTestCase`` commits, and a real worker runs
what a committed ``atomic()`` enqueued.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase

from pgbroker import testing
from pgbroker._pg.django_db import alias_conninfo
from tests.apps.django_project.celery import app
from tests.support.processes import WorkerProcess, run_worker, wait_for

from .models import Order
from .tasks import confirm_order


class Abort(Exception):
    """Raised inside atomic() to roll it back."""


def committed_jobs() -> list[tuple[str, str]]:
    """The jobs another session sees: committed ones only."""
    with psycopg.connect(alias_conninfo("default"), autocommit=True) as other:
        return other.execute("SELECT task, state FROM pgbroker.jobs").fetchall()


def assert_rollback_leaves_nothing(case: TestCase, publish: Callable[[int], Any],
                                   task: Any) -> None:
    """``publish(order id)`` inside an ``atomic()`` that rolls back: its job is in the
    transaction, and gone with it."""
    with case.assertRaises(Abort), transaction.atomic():
        publish(Order.objects.create(item="ghost").pk)
        testing.assert_enqueued(connection, task, count=1, app=app)
        raise Abort
    testing.refute_enqueued(connection, app=app)


@contextlib.contextmanager
def worker_on_test_database() -> Iterator[WorkerProcess]:
    """A real worker of the project, on the test database, stopped when the block ends."""
    db = connection.settings_dict
    url = f"pgbroker+postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    worker = run_worker("tests.apps.django_project.celery", url,
                        env={"DJANGO_SETTINGS_MODULE": "tests.apps.django_project.settings_atomic"})
    try:
        yield worker.wait_ready(60)
    finally:
        worker.stop()


class JoinAtomicTestCase(TestCase):
    def test_delay_is_written_in_the_tests_transaction(self) -> None:
        order = Order.objects.create(item="book")
        confirm_order.delay(order.pk)
        testing.assert_enqueued(connection, confirm_order, args=[order.pk], count=1, app=app)
        self.assertEqual(committed_jobs(), [])

    def test_a_rolled_back_atomic_enqueues_nothing(self) -> None:
        assert_rollback_leaves_nothing(self, confirm_order.delay, confirm_order)

    def test_a_rolled_back_savepoint_drops_only_its_job(self) -> None:
        with transaction.atomic():
            confirm_order.delay(1)
            with self.assertRaises(Abort), transaction.atomic():  # a SAVEPOINT
                confirm_order.delay(2)
                raise Abort
        testing.assert_enqueued(connection, confirm_order, args=[1], count=1, app=app)
        testing.refute_enqueued(connection, confirm_order, args=[2], app=app)

    def test_run_enqueued_runs_the_job_here(self) -> None:
        order = Order.objects.create(item="pen")
        confirm_order.delay(order.pk)
        [ran] = testing.run_enqueued(connection, app=app)
        self.assertEqual(ran.result.get(), order.pk)
        self.assertTrue(Order.objects.get(pk=order.pk).confirmed)
        testing.refute_enqueued(connection, app=app)
        testing.assert_enqueued(connection, confirm_order, states=["completed"], count=1, app=app)


class JoinAtomicWorkerTests(TransactionTestCase):
    def setUp(self) -> None:
        testing.clear_enqueued(connection, app=app)  # Django's flush empties models only

    def test_rollback_enqueues_nothing_commit_runs_once_on_a_worker(self) -> None:
        with self.assertRaises(Abort), transaction.atomic():
            confirm_order.delay(Order.objects.create(item="ghost").pk)
            raise Abort
        self.assertEqual(committed_jobs(), [])

        with transaction.atomic():
            order = Order.objects.create(item="lamp")
            confirm_order.delay(order.pk)
            self.assertEqual(committed_jobs(), [])  # not before the commit
        self.assertEqual(committed_jobs(), [(confirm_order.name, "pending")])

        with worker_on_test_database():
            wait_for(lambda: committed_jobs() == [(confirm_order.name, "completed")], 60,
                     message=lambda: f"the job completed (jobs: {committed_jobs()})")
        self.assertTrue(Order.objects.get(pk=order.pk).confirmed)

    def test_outside_atomic_nothing_changes(self) -> None:
        confirm_order.delay(0)  # autocommit: written at once by the broker's own connection
        self.assertEqual(committed_jobs(), [(confirm_order.name, "pending")])
