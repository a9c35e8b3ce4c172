"""The service layer: what the web handlers (and the tasks) of ticketflow call.

Every function takes a SQLAlchemy session with no transaction in progress and runs as ONE
transaction of its own, committed when it returns (rolled back when it raises). The jobs a change
needs are written in that same transaction through :mod:`ticketflow.jobs` (``pgbroker.enqueue``
by task name): a confirmed reservation always has its e-mail job, and a rolled back
confirmation never sends one. The tasks call this module; this module never imports the tasks.

Flow: :func:`reserve` holds seats for a while (``held``); :func:`confirm` makes it ``confirmed``
and enqueues the confirmation e-mail; :func:`pay` records a payment and enqueues its charge (the
charge task needs an idempotency key: ``payment:<id>``); a successful :func:`charge` enqueues the
PDF ticket. :func:`expire_reservations` (every minute, from beat) ends the holds nobody confirmed
in time and gives their seats back.

Errors: bad arguments raise ``ValueError``; the domain's refusals raise a
:class:`TicketflowError` subclass. Either way nothing was written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from . import gateway, jobs
from .models import (
    CONFIRMED,
    EXPIRED,
    FAILED,
    HELD,
    PENDING,
    SUCCEEDED,
    Event,
    OwnerNotice,
    Payment,
    PaymentAttempt,
    Reservation,
    SentEmail,
    TaskDedup,
    Ticket,
)

__all__ = [
    "TicketflowError", "NotFound", "SoldOut", "InvalidState", "HoldExpired",
    "PRICE_CENTS", "DEFAULT_HOLD_SECONDS",
    "create_event", "reserve", "confirm", "pay", "charge", "fail_payment",
    "send_confirmation", "render_ticket", "expire_reservations", "claim_once", "notify_owners",
]

logger = logging.getLogger(__name__)

#: Price of one seat, in cents.
PRICE_CENTS = 4500
#: How long a reservation holds its seats unless confirmed.
DEFAULT_HOLD_SECONDS = 600.0
#: Reservations expired per statement (and per transaction): row locks stay short.
EXPIRE_BATCH_SIZE = 100


class TicketflowError(Exception):
    """Base class of the domain's refusals."""


class NotFound(TicketflowError, LookupError):
    """No such event, reservation or payment."""


class SoldOut(TicketflowError):
    """The event has fewer free seats than asked for."""


class InvalidState(TicketflowError):
    """The reservation or payment is not in a state that allows this."""


class HoldExpired(InvalidState):
    """The reservation's hold ran out before it was confirmed."""


@contextmanager
def _transaction(session: Session) -> Iterator[None]:
    if session.in_transaction():
        raise RuntimeError("ticketflow services run their own transaction: pass a session "
                           "with no transaction in progress (commit or roll back first)")
    with session.begin():
        yield


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, not {value!r}")
    return value


def _id(value: Any, what: str) -> int:
    return _positive_int(value, f"{what} id")


# -- events and reservations ---------------------------------------------------------------------

def create_event(session: Session, name: str, capacity: int) -> Event:
    """Create an event with ``capacity`` seats."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"event name must be a non-empty string, not {name!r}")
    _positive_int(capacity, "capacity")
    with _transaction(session):
        event = Event(name=name.strip(), capacity=capacity, seats_taken=0)
        session.add(event)
    return event


def reserve(session: Session, event_id: int, email: str, seats: int = 1,
            hold_seconds: float = DEFAULT_HOLD_SECONDS) -> Reservation:
    """Hold ``seats`` of the event for ``hold_seconds`` (database clock).

    Raises:
        ValueError: a bad argument.
        NotFound: no such event.
        SoldOut: fewer than ``seats`` seats are free.
    """
    _id(event_id, "event")
    if not isinstance(email, str) or "@" not in email.strip(" @"):
        raise ValueError(f"email must be an e-mail address, not {email!r}")
    _positive_int(seats, "seats")
    if (not isinstance(hold_seconds, (int, float)) or isinstance(hold_seconds, bool)
            or not 0 < hold_seconds <= 86400):
        raise ValueError(f"hold_seconds must be a number of seconds in (0, 86400], "
                         f"not {hold_seconds!r}")
    with _transaction(session):
        # Take the seats with one conditional UPDATE: the row lock serialises concurrent
        # reservations of this event, and the condition is re-checked on the locked row.
        taken = session.execute(
            update(Event)
            .where(Event.id == event_id, Event.seats_taken + seats <= Event.capacity)
            .values(seats_taken=Event.seats_taken + seats)
            .returning(Event.id)).first()
        if taken is None:
            event = session.get(Event, event_id)
            if event is None:
                raise NotFound(f"no event {event_id}")
            raise SoldOut(f"event {event_id} has {event.capacity - event.seats_taken} free "
                          f"seat(s), {seats} asked for")
        reservation = session.scalar(
            insert(Reservation)
            .values(event_id=event_id, email=email.strip(), seats=seats, state=HELD,
                    hold_expires_at=func.now() + timedelta(seconds=hold_seconds))
            .returning(Reservation))
        assert reservation is not None
    return reservation


def confirm(session: Session, reservation_id: int) -> Reservation:
    """Confirm a held reservation and enqueue its confirmation e-mail, in one transaction.

    Confirming a reservation that is already confirmed changes nothing and sends nothing.

    Raises:
        NotFound: no such reservation.
        HoldExpired: its hold ran out (whether or not expire_reservations has run yet).
    """
    _id(reservation_id, "reservation")
    with _transaction(session):
        # FOR UPDATE: an expire_reservations running now either has this row (and we wait, then
        # see 'expired') or skips it (SKIP LOCKED) because we hold it.
        row = session.execute(
            select(Reservation, Reservation.hold_expires_at <= func.now(), func.now())
            .where(Reservation.id == reservation_id)
            .with_for_update(of=Reservation)).first()
        if row is None:
            raise NotFound(f"no reservation {reservation_id}")
        reservation, past_deadline, now = row
        if reservation.state == CONFIRMED:
            return reservation
        if reservation.state == EXPIRED or past_deadline:
            raise HoldExpired(f"reservation {reservation_id}'s hold expired at "
                              f"{reservation.hold_expires_at:%Y-%m-%d %H:%M:%S%z}")
        reservation.state, reservation.confirmed_at = CONFIRMED, now
        # The e-mail job commits with the confirmation, or not at all.
        jobs.send_confirmation_email(session, reservation.id)
    return reservation


def expire_reservations(session: Session, now: datetime | None = None,
                        batch_size: int = EXPIRE_BATCH_SIZE) -> int:
    """Expire the held reservations whose hold ended by ``now`` (default: the database clock)
    and give their seats back; return how many were expired.

    Works in batches of ``batch_size``, one transaction each, until a batch comes back short.
    Rows locked by someone else (a confirmation in progress, another expirer) are skipped, not
    waited for: a skipped reservation that is still held is taken by the next run.
    """
    _positive_int(batch_size, "batch_size")
    total = 0
    while True:
        with _transaction(session):
            done = session.execute(_EXPIRE_BATCH, {"now": now, "limit": batch_size}).scalar_one()
        total += done
        if done < batch_size:
            break
    if total:
        logger.info("expired %d reservation(s)", total)
    return total


_EXPIRE_BATCH = text("""
WITH due AS MATERIALIZED (
    -- Held reservations past their deadline, oldest first, one small batch: the row locks are
    -- held for one short statement. SKIP LOCKED: a reservation being confirmed right now (locked
    -- by confirm()) is left alone instead of waited for, and two expirers running at once take
    -- different rows. MATERIALIZED: an optimisation fence, so the LIMIT bounds what is locked.
    SELECT id
    FROM ticketflow.reservations
    WHERE state = 'held' AND hold_expires_at <= COALESCE(CAST(:now AS timestamptz), now())
    ORDER BY hold_expires_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), expired AS (
    -- End those holds; return the seats each one gives back.
    UPDATE ticketflow.reservations AS r
    SET state = 'expired', expired_at = COALESCE(CAST(:now AS timestamptz), now())
    FROM due
    WHERE r.id = due.id
    RETURNING r.event_id, r.seats
), freed AS (
    -- Give the seats back, one UPDATE per event rather than per reservation.
    UPDATE ticketflow.events AS e
    SET seats_taken = e.seats_taken - f.seats
    FROM (SELECT event_id, sum(seats) AS seats FROM expired GROUP BY event_id) AS f
    WHERE e.id = f.event_id
)
-- PostgreSQL runs every data-modifying CTE to completion, read or not: 'freed' runs too.
SELECT count(*) FROM expired
""")


# -- payments ------------------------------------------------------------------------------------

def pay(session: Session, reservation_id: int, card: str,
        amount_cents: int | None = None) -> Payment:
    """Record the payment of a confirmed reservation and enqueue its charge, in one transaction.

    ``amount_cents`` defaults to the seats times :data:`PRICE_CENTS`. Paying a reservation that
    already has a payment returns that payment and enqueues nothing (a client's retry).

    Raises:
        ValueError: a bad card or amount.
        NotFound: no such reservation.
        InvalidState: the reservation is not confirmed.
    """
    _id(reservation_id, "reservation")
    gateway.check_card(card)
    if amount_cents is not None:
        _positive_int(amount_cents, "amount_cents")
    with _transaction(session):
        reservation = session.get(Reservation, reservation_id, with_for_update=True)
        if reservation is None:
            raise NotFound(f"no reservation {reservation_id}")
        if reservation.state != CONFIRMED:
            raise InvalidState(f"reservation {reservation_id} is {reservation.state}: only a "
                               "confirmed reservation can be paid")
        existing = session.scalar(select(Payment).where(Payment.reservation_id == reservation_id))
        if existing is not None:
            return existing
        payment = Payment(reservation_id=reservation_id, card=card, state=PENDING,
                          amount_cents=amount_cents or reservation.seats * PRICE_CENTS,
                          gateway_calls=0)
        session.add(payment)
        session.flush()  # the id, for the idempotency key
        # A money task: its job carries the idempotency key payment:<id> (see jobs.py).
        jobs.charge_payment(session, payment.id)
    return payment


def charge(session: Session, payment_id: int) -> str:
    """Charge a payment through the gateway; return its state.

    A payment already ``succeeded`` is not charged again (a redelivered or retried message).
    Each gateway call is recorded (``payment_attempts``) and committed before an error is
    raised, so retries count the calls already made. On success the PDF ticket is enqueued in
    the same transaction.

    Raises:
        NotFound: no such payment.
        gateway.TransientPaymentError: try again later (the task retries with backoff).
        gateway.PaymentDeclined: permanent (the task fails; see :func:`fail_payment`).
    """
    _id(payment_id, "payment")
    failure: gateway.PaymentError | None = None
    with _transaction(session):
        # The row lock makes concurrent deliveries of one charge take turns: the second one
        # finds 'succeeded' and charges nothing.
        payment = session.get(Payment, payment_id, with_for_update=True)
        if payment is None:
            raise NotFound(f"no payment {payment_id}")
        if payment.state == SUCCEEDED:
            return payment.state
        payment.gateway_calls += 1
        attempt = PaymentAttempt(payment_id=payment.id, call=payment.gateway_calls,
                                 outcome="succeeded")
        try:
            reference = gateway.charge(payment.card, payment.amount_cents,
                                       f"payment:{payment.id}", payment.gateway_calls)
        except gateway.PaymentError as exc:
            failure = exc
            attempt.outcome = "declined" if isinstance(exc, gateway.PaymentDeclined) else \
                "transient"
            attempt.error = payment.last_error = f"{type(exc).__name__}: {exc}"
        else:
            payment.state, payment.gateway_ref, payment.last_error = SUCCEEDED, reference, None
            jobs.render_ticket_pdf(session, payment.reservation_id)
        payment.updated_at = func.now()
        session.add(attempt)
    if failure is not None:
        raise failure
    return payment.state


def fail_payment(session: Session, payment_id: int, error: str) -> bool:
    """Mark a payment ``failed`` with ``error`` (its charge gave up); False if it was not
    pending (already succeeded, or already failed)."""
    _id(payment_id, "payment")
    with _transaction(session):
        done = session.execute(
            update(Payment)
            .where(Payment.id == payment_id, Payment.state == PENDING)
            .values(state=FAILED, last_error=error[:2000], updated_at=func.now())
            .returning(Payment.id)).first()
    return done is not None


# -- idempotent side effects ---------------------------------------------------------------------

def claim_once(session: Session, key: str, task: str) -> bool:
    """Record that the side effect ``key`` is being done, in the caller's transaction; return
    False if it was done already (a redelivery: do nothing).

    Call it in the same transaction as the side effect itself, so that both commit or neither:
    a concurrent copy of the task waits on the key's unique index until this transaction ends.
    """
    inserted = session.execute(
        insert(TaskDedup).values(key=key, task=task)
        .on_conflict_do_nothing(index_elements=[TaskDedup.key])
        .returning(TaskDedup.key)).first()
    return inserted is not None


def send_confirmation(session: Session, reservation_id: int) -> bool:
    """"Send" the confirmation e-mail of a reservation (write it to ``sent_emails``), at most
    once per reservation whatever the number of deliveries; return False for a duplicate.

    Raises:
        NotFound: no such reservation.
        InvalidState: the reservation is not confirmed (nothing is recorded, so a later
            delivery can still send it).
    """
    _id(reservation_id, "reservation")
    with _transaction(session):
        if not claim_once(session, f"email:{reservation_id}:confirmation",
                          jobs.SEND_CONFIRMATION_EMAIL):
            logger.info("confirmation e-mail of reservation %s already sent", reservation_id)
            return False
        row = session.execute(
            select(Reservation, Event.name)
            .join(Event, Event.id == Reservation.event_id)
            .where(Reservation.id == reservation_id)).first()
        if row is None:
            raise NotFound(f"no reservation {reservation_id}")
        reservation, event_name = row
        if reservation.state != CONFIRMED:
            raise InvalidState(f"reservation {reservation_id} is {reservation.state}, not "
                               "confirmed: no confirmation e-mail")
        session.add(SentEmail(
            reservation_id=reservation.id, kind="confirmation", recipient=reservation.email,
            subject=f"Your reservation for {event_name} is confirmed",
            body=f"Reservation {reservation.id}: {reservation.seats} seat(s) for "
                 f"{event_name}. See you there!"))
    return True


def render_ticket(session: Session, reservation_id: int, seconds: float = 0.5) -> bool:
    """Render the PDF ticket of a confirmed reservation (a fake PDF; rendering is simulated by
    sleeping ``seconds``) and store it; False if it existed already.

    The render runs outside any transaction (no locks or connection held while it works); two
    concurrent renders of one ticket both work, and the first insert wins.

    Raises:
        NotFound: no such reservation.
        InvalidState: the reservation is not confirmed.
    """
    _id(reservation_id, "reservation")
    with _transaction(session):
        row = session.execute(
            select(Reservation, Event.name, Ticket.reservation_id)
            .join(Event, Event.id == Reservation.event_id)
            .outerjoin(Ticket, Ticket.reservation_id == Reservation.id)
            .where(Reservation.id == reservation_id)).first()
    if row is None:
        raise NotFound(f"no reservation {reservation_id}")
    reservation, event_name, existing = row
    if existing is not None:
        return False
    if reservation.state != CONFIRMED:
        raise InvalidState(f"reservation {reservation_id} is {reservation.state}: no ticket")
    time.sleep(seconds)
    pdf = (b"%PDF-1.4\n% ticketflow fake ticket\n"
           + f"({event_name}: reservation {reservation.id}, {reservation.seats} seat(s), "
             f"{reservation.email})\n".encode()
           + b"%%EOF\n")
    with _transaction(session):
        inserted = session.execute(
            insert(Ticket).values(reservation_id=reservation.id, pdf=pdf)
            .on_conflict_do_nothing(index_elements=[Ticket.reservation_id])
            .returning(Ticket.reservation_id)).first()
    return inserted is not None


def notify_owners(session: Session, owners: list[str], subject: str, body: str) -> int:
    """Tell each owner of the deployment: a notice in the app and an e-mail (``sent_emails``,
    with no reservation), in one transaction; returns how many owners."""
    if not owners:
        raise ValueError("no owner to notify")
    with _transaction(session):
        for owner in owners:
            session.add(OwnerNotice(owner=owner, subject=subject, body=body))
            session.add(SentEmail(reservation_id=None, kind="owner-notice", recipient=owner,
                                  subject=subject, body=body))
    return len(owners)
