"""The jobs ticketflow's services enqueue: the one door from the service layer to the queue.

The services (:mod:`ticketflow.services`) call these functions, inside their own transaction;
the tasks (:mod:`ticketflow.tasks`) call the services. So the dependency runs one way:
``tasks -> services -> jobs``, and this module names each task by its name rather than importing
the task code (as ``send_task`` does), so a web process enqueues without importing the worker's
code. Where the tasks are imported too (the worker, the tests), Celery's registry gives
``pgbroker.enqueue`` the task's own options, as for a task object.

Each function writes its job with :func:`pgbroker.enqueue` in ``session``'s transaction: the job
exists exactly when the caller commits.
"""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

import pgbroker

from . import app

__all__ = ["SEND_CONFIRMATION_EMAIL", "CHARGE_PAYMENT", "RENDER_TICKET_PDF",
           "send_confirmation_email", "charge_payment", "render_ticket_pdf"]

#: The task names (``ticketflow.tasks`` registers its tasks under these).
SEND_CONFIRMATION_EMAIL = "ticketflow.tasks.send_confirmation_email"
CHARGE_PAYMENT = "ticketflow.tasks.charge_payment"
RENDER_TICKET_PDF = "ticketflow.tasks.render_ticket_pdf"


def send_confirmation_email(session: Session, reservation_id: int) -> uuid.UUID:
    """The confirmation e-mail of a reservation."""
    return pgbroker.enqueue(session, SEND_CONFIRMATION_EMAIL, (reservation_id,), app=app)


def charge_payment(session: Session, payment_id: int) -> uuid.UUID:
    """The charge of a payment. A money task: pgbroker refuses it without a key
    (``require_idempotency_key`` in ``celeryconfig.py``), and the key makes a second enqueue of
    this payment a no-op."""
    return pgbroker.enqueue(session, CHARGE_PAYMENT, (payment_id,),
                            idempotency_key=f"payment:{payment_id}", app=app)


def render_ticket_pdf(session: Session, reservation_id: int) -> uuid.UUID:
    """The PDF ticket of a paid reservation."""
    return pgbroker.enqueue(session, RENDER_TICKET_PDF, (reservation_id,), app=app)
