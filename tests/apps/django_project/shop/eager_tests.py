"""Django's ``TestCase`` in Celery's eager mode (``settings_eager``): ``.delay()`` and
``pgbroker.contrib.django.enqueue`` run the task at once and write no job. Not found by the
default discovery (``test*.py``): ``tests/django_app/test_django_runner.py`` names it."""

from __future__ import annotations

from django.db import connection
from django.test import TestCase

from pgbroker import testing
from pgbroker.contrib import django as pgdjango
from tests.apps.django_project.celery import app

from .models import Order
from .tasks import confirm_order


class EagerTestCase(TestCase):
    def test_delay_and_enqueue_run_the_task_now(self) -> None:
        first, second = (Order.objects.create(item=item) for item in ("a", "b"))
        confirm_order.delay(first.pk)
        pgdjango.enqueue(confirm_order, (second.pk,))
        self.assertEqual(Order.objects.filter(confirmed=True).count(), 2)
        testing.refute_enqueued(connection, app=app)

    def test_a_failure_propagates(self) -> None:
        with self.assertRaises(LookupError):
            pgdjango.enqueue(confirm_order, (404,))
