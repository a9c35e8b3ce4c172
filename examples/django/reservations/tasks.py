"""The Celery tasks, thin: each calls the service layer or does one idempotent side effect."""

from celery import shared_task
from django.core.mail import send_mail
from django.db import IntegrityError, OperationalError, transaction

from .models import Charge, Reservation, SentEmail


@shared_task(autoretry_for=(OperationalError,), retry_backoff=True, retry_jitter=True,
             max_retries=5)
def expire_reservations() -> int:
    """Run by beat every minute."""
    from .services import expire  # the services import this module's tasks

    return expire()


@shared_task(autoretry_for=(OperationalError,), retry_backoff=True, retry_jitter=True)
def send_confirmation_email(ref: str) -> bool:
    """Send the confirmation once: the SentEmail row and the e-mail share a transaction, so a
    redelivery after a crash finds the row or sends again, never twice."""
    reservation = Reservation.objects.get(ref=ref)
    try:
        with transaction.atomic():
            SentEmail.objects.create(ref=ref, kind="confirmation")
            send_mail(f"Reservation {ref} confirmed", "See you there.", None,
                      [reservation.email])
    except IntegrityError:
        return False  # sent already
    return True


@shared_task(autoretry_for=(OperationalError,), retry_backoff=True, retry_jitter=True)
def charge_payment(ref: str) -> int:
    """Charge a confirmed reservation once (the gateway would take ``charge:{ref}`` as its
    idempotency key; here the unique Charge row plays the gateway)."""
    reservation = Reservation.objects.get(ref=ref)
    charge, _ = Charge.objects.get_or_create(reservation=reservation,
                                             defaults={"amount_cents": reservation.amount_cents})
    return charge.amount_cents
