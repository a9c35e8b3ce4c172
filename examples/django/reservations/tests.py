"""The example's tests, as a Django team writes them: ``python manage.py test``.

``TestCase`` wraps each test in a transaction; with ``PGBROKER_JOIN_ATOMIC`` the jobs a test
enqueues are in it too, seen on ``django.db.connection`` by ``pgbroker.testing`` and run here by
``run_enqueued``. With ``CELERY_TASK_ALWAYS_EAGER=1`` in the environment the same suite runs in
Celery's eager mode: the tasks run at ``.delay()`` and nothing is enqueued.
"""

from datetime import timedelta

from django.core import mail
from django.db import connection
from django.test import TestCase
from django.utils import timezone

from pgbroker import testing
from ticketsite.celery import app

from .models import Charge, Reservation, SentEmail
from .services import confirm, expire
from .tasks import charge_payment, send_confirmation_email

EAGER = app.conf.task_always_eager


def held(ref: str, minutes: int = 10) -> Reservation:
    return Reservation.objects.create(ref=ref, email=f"{ref}@example.com", amount_cents=4200,
                                      expires_at=timezone.now() + timedelta(minutes=minutes))


class ConfirmTests(TestCase):
    def test_confirm_sends_one_email_and_charges_once(self) -> None:
        held("R-1")
        confirm("R-1")
        if not EAGER:
            testing.assert_enqueued(connection, send_confirmation_email, args=["R-1"], count=1)
            testing.assert_enqueued(connection, charge_payment, args=["R-1"], count=1)
            testing.run_enqueued(connection)
        self.assertEqual(len(mail.outbox), 1)
        self.assertEqual(Charge.objects.get().amount_cents, 4200)
        self.assertTrue(SentEmail.objects.filter(ref="R-1").exists())

    def test_a_refused_confirmation_enqueues_nothing(self) -> None:
        held("R-2", minutes=-1)  # its time is up
        with self.assertRaises(ValueError):
            confirm("R-2")
        testing.refute_enqueued(connection)
        self.assertEqual(mail.outbox, [])

    def test_the_charge_has_one_job_per_reservation(self) -> None:
        if EAGER:
            self.skipTest("eager mode runs each call; the idempotency key is the queue's")
        held("R-3")
        confirm("R-3")
        from pgbroker.contrib import django as pgdjango

        pgdjango.enqueue(charge_payment, ("R-3",), idempotency_key="charge:R-3")  # a retry
        testing.assert_enqueued(connection, charge_payment, count=1)

    def test_the_confirm_endpoint(self) -> None:
        held("R-5")
        self.assertEqual(self.client.post("/reservations/R-5/confirm").json()["status"],
                         "confirmed")
        self.assertEqual(self.client.post("/reservations/R-5/confirm").status_code, 409)
        if not EAGER:
            testing.assert_enqueued(connection, send_confirmation_email, args=["R-5"], count=1)

    def test_a_redelivered_email_is_not_sent_twice(self) -> None:
        held("R-4")
        Reservation.objects.filter(ref="R-4").update(status=Reservation.CONFIRMED)
        self.assertTrue(send_confirmation_email("R-4"))
        self.assertFalse(send_confirmation_email("R-4"))
        self.assertEqual(len(mail.outbox), 1)


class ExpireTests(TestCase):
    def test_expire_reservations_expires_what_is_due(self) -> None:
        held("old", minutes=-5)
        held("new")
        self.assertEqual(expire(), 1)
        self.assertEqual(Reservation.objects.get(ref="old").status, Reservation.EXPIRED)

    def test_beat_runs_it_every_minute(self) -> None:
        entry = app.conf.beat_schedule["expire-reservations-every-minute"]
        self.assertEqual(entry["task"], "reservations.tasks.expire_reservations")
