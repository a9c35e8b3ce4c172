"""The business logic: transactions here, tasks enqueued inside them."""

from django.db import transaction
from django.utils import timezone

from pgbroker.contrib import django as pgdjango

from .models import Reservation
from .tasks import charge_payment, send_confirmation_email


def confirm(ref: str) -> Reservation:
    """Confirm a held reservation; its e-mail and its charge are enqueued in the same
    transaction, so they exist exactly when the confirmation commits (no on_commit)."""
    with transaction.atomic():
        reservation = Reservation.objects.select_for_update().get(ref=ref)
        if reservation.status != Reservation.HELD or reservation.expires_at <= timezone.now():
            raise ValueError(f"reservation {ref} cannot be confirmed ({reservation.status})")
        reservation.status = Reservation.CONFIRMED
        reservation.save(update_fields=["status"])
        send_confirmation_email.delay(ref)     # joins this atomic() (PGBROKER_JOIN_ATOMIC)
        # money: at most one charge job per reservation, whoever enqueues it, however often
        pgdjango.enqueue(charge_payment, (ref,), idempotency_key=f"charge:{ref}")
        return reservation


def expire(now=None) -> int:
    """Expire the held reservations whose time is up; how many."""
    return Reservation.objects.filter(status=Reservation.HELD,
                                      expires_at__lte=now or timezone.now()).update(
        status=Reservation.EXPIRED)
