"""Django's task framework on pgbroker's backend (``shop/jobs.py``), under ``manage.py test``
(``settings_atomic``): ``enqueue`` joins the caller's ``atomic()`` on Django's connection,
``run_after``, priority and queue land in the job, and ``get_result`` reads what a real worker
did. Not found by the default discovery (``test*.py``): tests/django_app/test_django_runner.py
names it."""

from __future__ import annotations

from datetime import timedelta

from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase
from django.utils import timezone
from django_tasks import TaskResultStatus
from django_tasks.exceptions import TaskResultDoesNotExist

from pgbroker import testing
from pgbroker.contrib.django.tasks import TASK_NAME
from tests.apps.django_project.celery import app
from tests.support.processes import wait_for

from .jobs import confirm, urgent
from .models import Order
from .tests import assert_rollback_leaves_nothing, committed_jobs, worker_on_test_database


class BackendTestCase(TestCase):
    def test_enqueue_joins_the_callers_atomic(self) -> None:
        assert_rollback_leaves_nothing(self, confirm.enqueue, TASK_NAME)

    def test_run_after_priority_and_queue(self) -> None:
        later = timezone.now() + timedelta(hours=1)
        result = urgent.using(run_after=later).enqueue("hi")
        [job] = testing.enqueued(connection, TASK_NAME, app=app)
        self.assertEqual((job.queue, job.priority, job.state), ("urgent", 150, "scheduled"))
        self.assertEqual(job.args, ["tests.apps.django_project.shop.jobs.urgent", ["hi"], {}])
        self.assertGreaterEqual(job.run_at, later - timedelta(seconds=1))
        found = urgent.get_result(result.id)
        self.assertEqual((found.status, found.args), (TaskResultStatus.READY, ["hi"]))

    def test_an_unknown_id(self) -> None:
        with self.assertRaises(TaskResultDoesNotExist):
            confirm.get_backend().get_result("no-such-task")


class BackendWorkerTests(TransactionTestCase):
    def setUp(self) -> None:
        testing.clear_enqueued(connection, app=app)

    def test_a_worker_runs_them_and_get_result_tells(self) -> None:
        with transaction.atomic():
            order = Order.objects.create(item="lamp")
            ok = confirm.enqueue(order.pk)
            self.assertEqual(committed_jobs(), [])
        failing = confirm.enqueue(404)

        with worker_on_test_database() as worker:
            wait_for(lambda: confirm.get_result(failing.id).status == TaskResultStatus.FAILED
                     and confirm.get_result(ok.id).status == TaskResultStatus.SUCCESSFUL, 60,
                     message=lambda: f"both tasks finished (jobs: {committed_jobs()}; worker: "
                                     f"{worker.log()[-3000:]})")
        done = confirm.get_result(ok.id)
        self.assertEqual(done.return_value, order.pk)
        self.assertTrue(done.worker_ids and done.started_at and done.finished_at)
        self.assertTrue(Order.objects.get(pk=order.pk).confirmed)
        [error] = confirm.get_result(failing.id).errors
        self.assertEqual(error.exception_class_path, "builtins.LookupError")
        self.assertIn("order 404 does not exist", error.traceback)
