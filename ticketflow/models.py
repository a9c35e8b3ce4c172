"""SQLAlchemy 2 models of ticketflow's own schema (``ticketflow``, separate from pgbroker's).

The tables are created by the numbered SQL files in ``ticketflow/migrations`` (applied with
pgbroker's migration runner, see :func:`ticketflow.db.migrate`), never by ``create_all``: the SQL
is the source of truth and carries the CHECK constraints; these classes map it. A test checks that
both name the same columns.

State machines:

* reservation: ``held`` -> ``confirmed`` | ``expired`` (a hold past its deadline)
* payment: ``pending`` -> ``succeeded`` | ``failed`` (declined, or out of retries)
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    ForeignKey,
    LargeBinary,
    MetaData,
    Text,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "SCHEMA", "Base", "Event", "Reservation", "Payment", "PaymentAttempt", "SentEmail",
    "OwnerNotice", "TaskDedup", "Ticket", "HELD", "CONFIRMED", "EXPIRED", "PENDING",
    "SUCCEEDED", "FAILED",
]

SCHEMA = "ticketflow"

# Reservation states.
HELD, CONFIRMED, EXPIRED = "held", "confirmed", "expired"
# Payment states.
PENDING, SUCCEEDED, FAILED = "pending", "succeeded", "failed"

Timestamp = DateTime(timezone=True)


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    capacity: Mapped[int]
    seats_taken: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class Reservation(Base):
    __tablename__ = "reservations"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger, ForeignKey(Event.id))
    email: Mapped[str] = mapped_column(Text)
    seats: Mapped[int]
    state: Mapped[str] = mapped_column(Text, default=HELD)
    hold_expires_at: Mapped[datetime] = mapped_column(Timestamp)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    confirmed_at: Mapped[datetime | None] = mapped_column(Timestamp)
    expired_at: Mapped[datetime | None] = mapped_column(Timestamp)


class Payment(Base):
    __tablename__ = "payments"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    reservation_id: Mapped[int] = mapped_column(BigInteger, ForeignKey(Reservation.id),
                                                unique=True)
    amount_cents: Mapped[int]
    card: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text, default=PENDING)
    gateway_calls: Mapped[int] = mapped_column(default=0)
    gateway_ref: Mapped[str | None] = mapped_column(Text)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class PaymentAttempt(Base):
    __tablename__ = "payment_attempts"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    payment_id: Mapped[int] = mapped_column(BigInteger, ForeignKey(Payment.id))
    call: Mapped[int]
    outcome: Mapped[str] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.clock_timestamp())


class SentEmail(Base):
    __tablename__ = "sent_emails"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: None for an e-mail to the owners (migration 0002)
    reservation_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey(Reservation.id))
    kind: Mapped[str] = mapped_column(Text)
    recipient: Mapped[str] = mapped_column(Text)
    subject: Mapped[str] = mapped_column(Text)
    body: Mapped[str] = mapped_column(Text)
    sent_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class TaskDedup(Base):
    """A side effect already done, by key: see :func:`ticketflow.services.claim_once`."""

    __tablename__ = "task_dedup"

    key: Mapped[str] = mapped_column(Text, primary_key=True)
    task: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class Ticket(Base):
    __tablename__ = "tickets"

    reservation_id: Mapped[int] = mapped_column(BigInteger, ForeignKey(Reservation.id),
                                                primary_key=True)
    pdf: Mapped[bytes] = mapped_column(LargeBinary)
    rendered_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class OwnerNotice(Base):
    """A notice to an owner of the deployment, shown in the app (migration 0002)."""

    __tablename__ = "owner_notices"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    owner: Mapped[str] = mapped_column(Text)
    subject: Mapped[str] = mapped_column(Text)
    body: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    read_at: Mapped[datetime | None] = mapped_column(Timestamp)
