"""ticketflow's Celery tasks, written as any Celery user writes them (``@shared_task``).

Each task is thin: it opens a session and calls the service layer (:mod:`ticketflow.services`),
where the transactions are; the services enqueue these tasks by name (:mod:`ticketflow.jobs`),
never importing this module, so the dependency runs one way. Delivery is at least once
(``task_acks_late``): every task is idempotent, so a redelivery (a worker killed mid-task, a
duplicated message) does no harm.

* :func:`send_confirmation_email` (queue ``email``): one e-mail per reservation, kept by a
  ``task_dedup`` row written in the same transaction as the e-mail.
* :func:`charge_payment`: a money task. pgbroker refuses to enqueue it without an idempotency key
  (``require_idempotency_key`` in ``celeryconfig.py``); transient gateway and database errors are
  retried after seed 000's fixed table of waits (10 s, 40 s, 3 min, 12 min; with jitter:
  :class:`pgbroker.backoff.TableBackoff`; ``TICKETFLOW_CHARGE_BACKOFF`` sets another table, the
  demo and the tests a short one); a declined card, or the last retry's failure, ends the job
  ``dead`` in pgbroker with its error (a dead letter an operator sees, logged at CRITICAL by
  :mod:`ticketflow.alerts`) and the payment ``failed``.
* :func:`expire_reservations`: run by beat every minute.
* :func:`render_ticket_pdf`: slow, with a time limit.

Each task runs in a pool made for what it spends (``task_routes`` in ``celeryconfig.py``, one
worker per pool in ``docker-compose.yml``): ``system`` (short sweeps), ``heavy`` (CPU and memory:
one job per pool process, replaced above a memory cap) and ``io`` (e-mails and charges, which
mostly wait on other systems: many at a time).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import shared_task
from sqlalchemy.exc import OperationalError

from pgbroker import DatabaseUnavailable
from pgbroker.backoff import SEED_TABLE, TableBackoff

from . import db, jobs, services
from .gateway import TransientPaymentError

__all__ = ["send_confirmation_email", "charge_payment", "expire_reservations",
           "render_ticket_pdf", "CHARGE_MAX_RETRIES"]

logger = logging.getLogger(__name__)

#: Retries of a charge after its first attempt.
CHARGE_MAX_RETRIES = 4
#: Seconds between a charge's retries, comma-separated (default: seed 000's table).
ENV_CHARGE_BACKOFF = "TICKETFLOW_CHARGE_BACKOFF"
#: Seconds a (fake) PDF render takes; the demo and the tests shorten it.
ENV_PDF_SECONDS = "TICKETFLOW_PDF_SECONDS"


@shared_task(name=jobs.SEND_CONFIRMATION_EMAIL)
def send_confirmation_email(reservation_id: int) -> bool:
    """Send the confirmation e-mail of a reservation, once; False for a duplicate delivery."""
    with db.session() as session:
        return services.send_confirmation(session, reservation_id)


def _charge_backoff() -> tuple[float, ...]:
    text = os.environ.get(ENV_CHARGE_BACKOFF)
    return tuple(float(s) for s in text.split(",")) if text else SEED_TABLE


class _PaymentTask(TableBackoff):
    """Retries after the table of waits; marks the payment ``failed`` when its charge gives up
    (declined, or out of retries).

    ``on_failure`` runs for the final failure only, not for the retries.
    """

    retry_table = _charge_backoff()

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        payment_id = (kwargs or {}).get("payment_id", args[0] if args else None)
        if not isinstance(payment_id, int):
            return
        try:
            with db.session() as session:
                services.fail_payment(session, payment_id, f"{type(exc).__name__}: {exc}")
        except Exception:  # the task's own failure is what must be reported
            logger.exception("could not mark payment %s failed", payment_id)


@shared_task(name=jobs.CHARGE_PAYMENT, base=_PaymentTask,
             autoretry_for=(TransientPaymentError, OperationalError, DatabaseUnavailable),
             max_retries=CHARGE_MAX_RETRIES)
def charge_payment(payment_id: int) -> str:
    """Charge a payment; returns its state. See :func:`ticketflow.services.charge`."""
    with db.session() as session:
        return services.charge(session, payment_id)


@shared_task(name="ticketflow.tasks.expire_reservations")
def expire_reservations() -> int:
    """Expire the holds past their deadline and free their seats; returns how many."""
    with db.session() as session:
        return services.expire_reservations(session)


@shared_task(name=jobs.RENDER_TICKET_PDF, time_limit=30, soft_time_limit=25)
def render_ticket_pdf(reservation_id: int) -> bool:
    """Render and store the PDF ticket of a paid reservation; False if it existed already."""
    seconds = float(os.environ.get(ENV_PDF_SECONDS) or 0.5)
    with db.session() as session:
        return services.render_ticket(session, reservation_id, seconds)
