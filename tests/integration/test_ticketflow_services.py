"""ticketflow's service layer against a real PostgreSQL (no worker): migrations, the domain's
rules and refusals, the jobs written in the same transaction, idempotent side effects, and the
expiry's batches and SKIP LOCKED.

Every refusal is checked to have written nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

import pgbroker
import ticketflow
from tests.support.processes import REPO_ROOT, wait_for
from tests.support.tickets import confirmed, held, jobs_of, rows, seats_taken
from ticketflow import db, gateway, services, tasks
from ticketflow.models import Base


def count(pg: psycopg.Connection, table: str) -> int:
    return pg.execute(f"SELECT count(*) FROM ticketflow.{table}").fetchone()[0]


def lock_waits(pg: psycopg.Connection) -> int:
    """Sessions of this test's database waiting for a lock."""
    return pg.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                      " AND wait_event_type = 'Lock'").fetchone()[0]


# -- schema --------------------------------------------------------------------------------------

def test_the_migrations_create_exactly_the_tables_and_columns_the_models_map(
        tf_url: str, pg: psycopg.Connection) -> None:
    found: dict[str, dict[str, bool]] = {}
    for table, column, nullable in pg.execute(
            "SELECT table_name, column_name, is_nullable = 'YES' FROM information_schema.columns"
            " WHERE table_schema = 'ticketflow' AND table_name <> 'migrations'"):
        found.setdefault(table, {})[column] = nullable
    mapped = {t.name: {c.name: c.nullable for c in t.columns}
              for t in Base.metadata.tables.values()}
    assert found == mapped
    assert rows(pg, "SELECT version, name FROM ticketflow.migrations") == [
        {"version": 1, "name": "initial"}, {"version": 2, "name": "owner_notices"}]
    assert db.migrate(tf_url) == []  # a second run applies nothing


def test_the_state_checks_of_the_schema_refuse_impossible_rows(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = held(session, event)
    with pytest.raises(psycopg.errors.CheckViolation):
        pg.execute("UPDATE ticketflow.reservations SET state = 'confirmed' WHERE id = %s", (rid,))
    with pytest.raises(psycopg.errors.CheckViolation):
        pg.execute("UPDATE ticketflow.events SET seats_taken = capacity + 1 WHERE id = %s",
                   (event,))


# -- reserve -------------------------------------------------------------------------------------

def test_reserve_takes_seats_and_refuses_what_is_not_there(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    reservation = services.reserve(session, event, "fan@example.com", 15, hold_seconds=60)
    assert reservation.state == "held" and reservation.seats == 15
    created = pg.execute("SELECT hold_expires_at - created_at FROM ticketflow.reservations"
                         " WHERE id = %s", (reservation.id,)).fetchone()[0]
    assert created == timedelta(seconds=60)
    assert seats_taken(pg, event) == 15

    with pytest.raises(services.SoldOut, match="5 free seat"):
        services.reserve(session, event, "late@example.com", 6)
    with pytest.raises(services.NotFound, match="no event 999"):
        services.reserve(session, 999, "fan@example.com", 1)
    assert seats_taken(pg, event) == 15 and count(pg, "reservations") == 1  # nothing written
    services.reserve(session, event, "last@example.com", 5)  # exactly the rest: fine
    assert seats_taken(pg, event) == 20


@pytest.mark.parametrize("kwargs, message", [
    ({"seats": 0}, "seats must be a positive integer"),
    ({"seats": True}, "seats must be a positive integer"),
    ({"email": "not an address"}, "email must be an e-mail address"),
    ({"email": "@"}, "email must be an e-mail address"),
    ({"hold_seconds": 0}, "hold_seconds"),
    ({"hold_seconds": float("nan")}, "hold_seconds"),
    ({"event_id": "1"}, "event id must be a positive integer"),
])
def test_reserve_refuses_bad_arguments_and_writes_nothing(
        session: Session, event: int, pg: psycopg.Connection, kwargs: dict, message: str) -> None:
    args = {"event_id": event, "email": "fan@example.com", "seats": 1, "hold_seconds": 60,
            **kwargs}
    with pytest.raises(ValueError, match=message):
        services.reserve(session, **args)
    assert seats_taken(pg, event) == 0 and count(pg, "reservations") == 0


def test_a_service_refuses_a_session_with_a_transaction_in_progress(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    session.execute(text("SELECT 1"))  # autobegins
    with pytest.raises(RuntimeError, match="own transaction"):
        services.reserve(session, event, "fan@example.com")
    session.rollback()
    assert count(pg, "reservations") == 0


# -- confirm: the e-mail job commits with the confirmation ----------------------------------------

def test_confirm_enqueues_one_email_job_in_the_confirming_transaction(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = held(session, event)
    assert jobs_of(pg, "send_confirmation_email") == []
    reservation = services.confirm(session, rid)
    assert reservation.state == "confirmed" and reservation.confirmed_at is not None
    [job] = jobs_of(pg, "send_confirmation_email")
    assert (job["queue"], job["state"], job["arg"]) == ("email", "pending", rid)
    # the same transaction: the job was created by the transaction that confirmed
    same = pg.execute("SELECT r.xmin = j.xmin FROM ticketflow.reservations r, pgbroker.jobs j"
                      " WHERE r.id = %s AND j.id = %s", (rid, job["id"])).fetchone()[0]
    assert same

    services.confirm(session, rid)  # confirming again changes nothing and sends nothing
    assert len(jobs_of(pg, "send_confirmation_email")) == 1


def test_confirm_refuses_an_expired_hold_and_enqueues_nothing(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = held(session, event)
    pg.execute("UPDATE ticketflow.reservations SET hold_expires_at = now() - interval '1 s'"
               " WHERE id = %s", (rid,))
    with pytest.raises(services.HoldExpired, match=f"reservation {rid}'s hold expired"):
        services.confirm(session, rid)  # past its deadline, not yet expired by the task
    services.expire_reservations(session)
    with pytest.raises(services.HoldExpired):
        services.confirm(session, rid)  # expired
    with pytest.raises(services.NotFound):
        services.confirm(session, 12345)
    assert jobs_of(pg, "send_confirmation_email") == []
    assert rows(pg, "SELECT state FROM ticketflow.reservations") == [{"state": "expired"}]


# -- pay and charge ------------------------------------------------------------------------------

def test_pay_enqueues_the_charge_with_its_idempotency_key_once(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = confirmed(session, event, seats=2)
    payment = services.pay(session, rid, "4242 4242 4242 4242")
    assert (payment.state, payment.amount_cents) == ("pending", 2 * services.PRICE_CENTS)
    again = services.pay(session, rid, "4242 4242 4242 4242")  # a client's retry
    assert again.id == payment.id
    [job] = jobs_of(pg, "charge_payment")
    assert (job["idempotency_key"], job["queue"], job["arg"]) == (
        f"payment:{payment.id}", "default", payment.id)


def test_the_charge_task_cannot_be_enqueued_without_an_idempotency_key(
        session: Session, tf_url: str, pg: psycopg.Connection) -> None:
    with pytest.raises(pgbroker.IdempotencyKeyRequired, match="charge_payment"):
        with session.begin():
            pgbroker.enqueue(session, tasks.charge_payment, (1,), app=ticketflow.app)
    with pytest.raises(pgbroker.IdempotencyKeyRequired):
        tasks.charge_payment.delay(1)  # plain Celery publishing is refused too
    assert jobs_of(pg, "charge_payment") == []


@pytest.mark.parametrize("card, amount, error", [
    ("", None, ValueError), ("transient-x", None, ValueError), (None, None, ValueError),
    ("4242", 0, ValueError), ("4242", -5, ValueError),
])
def test_pay_refuses_bad_cards_and_amounts_and_writes_nothing(
        session: Session, event: int, pg: psycopg.Connection, card: object, amount: object,
        error: type[Exception]) -> None:
    rid = confirmed(session, event)
    with pytest.raises(error):
        services.pay(session, rid, card, amount)  # type: ignore[arg-type]
    assert count(pg, "payments") == 0 and jobs_of(pg, "charge_payment") == []


def test_pay_refuses_a_reservation_that_is_not_confirmed(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    with pytest.raises(services.InvalidState, match="is held"):
        services.pay(session, held(session, event), "4242")
    with pytest.raises(services.NotFound):
        services.pay(session, 999, "4242")
    assert count(pg, "payments") == 0 and jobs_of(pg, "charge_payment") == []


def test_charge_records_every_gateway_call_and_never_charges_twice(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    payment = services.pay(session, confirmed(session, event), "transient-1")
    with pytest.raises(gateway.TransientPaymentError, match="call 1"):
        services.charge(session, payment.id)
    # the failed call is committed: the retry knows it is the second call
    assert services.charge(session, payment.id) == "succeeded"
    assert services.charge(session, payment.id) == "succeeded"  # a redelivery: no third call
    [state] = rows(pg, "SELECT state, gateway_calls, gateway_ref IS NOT NULL AS ref, last_error"
                       " FROM ticketflow.payments")
    assert state == {"state": "succeeded", "gateway_calls": 2, "ref": True, "last_error": None}
    assert [r["outcome"] for r in rows(pg, "SELECT outcome FROM ticketflow.payment_attempts"
                                           " ORDER BY call")] == ["transient", "succeeded"]
    [render] = jobs_of(pg, "render_ticket_pdf")  # the ticket, enqueued with the success
    assert render["arg"] == payment.reservation_id


def test_a_declined_charge_raises_and_fail_payment_marks_it_failed(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    payment = services.pay(session, confirmed(session, event), "declined")
    with pytest.raises(gateway.PaymentDeclined):
        services.charge(session, payment.id)
    assert services.fail_payment(session, payment.id, "PaymentDeclined: card declined")
    assert not services.fail_payment(session, payment.id, "again")  # already failed
    [state] = rows(pg, "SELECT state, last_error FROM ticketflow.payments")
    assert state == {"state": "failed", "last_error": "PaymentDeclined: card declined"}
    assert jobs_of(pg, "render_ticket_pdf") == []
    with pytest.raises(services.NotFound):
        services.charge(session, 999)


# -- idempotent side effects ---------------------------------------------------------------------

def test_the_confirmation_email_is_sent_once_however_often_it_is_asked_for(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = confirmed(session, event)
    assert services.send_confirmation(session, rid) is True
    assert services.send_confirmation(session, rid) is False
    [email] = rows(pg, "SELECT reservation_id, kind, recipient FROM ticketflow.sent_emails")
    assert email == {"reservation_id": rid, "kind": "confirmation",
                     "recipient": "fan@example.com"}
    assert rows(pg, "SELECT key FROM ticketflow.task_dedup") == [
        {"key": f"email:{rid}:confirmation"}]


def test_no_email_for_a_reservation_that_is_not_confirmed_and_it_can_still_be_sent_later(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = held(session, event)
    with pytest.raises(services.InvalidState, match="not confirmed"):
        services.send_confirmation(session, rid)
    assert count(pg, "task_dedup") == 0 and count(pg, "sent_emails") == 0  # rolled back
    services.confirm(session, rid)
    assert services.send_confirmation(session, rid) is True
    with pytest.raises(services.NotFound):
        services.send_confirmation(session, 999)


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_concurrent_copy_waits_for_the_first_and_then_does_only_what_is_left(
        session: Session, event: int, pg: psycopg.Connection, tf_url: str,
        first_commits: bool) -> None:
    rid = confirmed(session, event)
    key = f"email:{rid}:confirmation"
    with db.session(tf_url) as first:
        first.begin()
        assert services.claim_once(first, key, "test")  # the first copy, still in progress
        result: list[bool] = []

        def second_copy() -> None:
            with db.session(tf_url) as other:
                result.append(services.send_confirmation(other, rid))

        copy = threading.Thread(target=second_copy)
        copy.start()
        # the copy blocks on the key's unique index (it neither sends nor skips yet)
        wait_for(lambda: lock_waits(pg) > 0, 30, message="the copy to wait")
        assert result == [] and copy.is_alive()
        first.commit() if first_commits else first.rollback()
        copy.join(30)
    assert result == [not first_commits]
    assert count(pg, "sent_emails") == (0 if first_commits else 1)


def test_render_ticket_stores_one_pdf_per_confirmed_reservation(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    rid = confirmed(session, event)
    assert services.render_ticket(session, rid, seconds=0) is True
    assert services.render_ticket(session, rid, seconds=0) is False
    [ticket] = rows(pg, "SELECT reservation_id, pdf FROM ticketflow.tickets")
    assert ticket["reservation_id"] == rid and bytes(ticket["pdf"]).startswith(b"%PDF-")
    with pytest.raises(services.InvalidState):
        services.render_ticket(session, held(session, event), seconds=0)
    with pytest.raises(services.NotFound):
        services.render_ticket(session, 999, seconds=0)
    assert count(pg, "tickets") == 1


# -- expire_reservations -------------------------------------------------------------------------

def test_expiry_ends_the_holds_past_their_deadline_and_frees_their_seats(
        session: Session, event: int, pg: psycopg.Connection) -> None:
    short = [held(session, event, seats=2, hold=60) for _ in range(5)]
    long_hold = held(session, event, seats=1, hold=3600)
    kept = confirmed(session, event, seats=3)
    assert seats_taken(pg, event) == 14
    now = pg.execute("SELECT now()").fetchone()[0]

    assert services.expire_reservations(session, now=now + timedelta(seconds=30)) == 0
    # batches of 2: three transactions for five reservations
    assert services.expire_reservations(session, now=now + timedelta(seconds=61),
                                        batch_size=2) == 5
    states = {r["id"]: r["state"] for r in rows(pg, "SELECT id, state FROM "
                                                    "ticketflow.reservations")}
    assert states == {**{rid: "expired" for rid in short}, long_hold: "held",
                      kept: "confirmed"}
    assert seats_taken(pg, event) == 4
    assert services.expire_reservations(session, now=now + timedelta(seconds=61)) == 0
    with pytest.raises(ValueError):
        services.expire_reservations(session, batch_size=0)


def test_expiry_skips_a_reservation_locked_by_a_confirmation_instead_of_waiting(
        session: Session, event: int, pg: psycopg.Connection, tf_url: str) -> None:
    due = [held(session, event, hold=1) for _ in range(3)]
    later = pg.execute("SELECT now() + interval '1 minute'").fetchone()[0]
    with psycopg.connect(tf_url) as confirming:  # a confirmation in progress holds this row
        confirming.execute("SELECT 1 FROM ticketflow.reservations WHERE id = %s FOR UPDATE",
                           (due[0],))
        done: list[int] = []

        def expire() -> None:
            with db.session(tf_url) as other:
                done.append(services.expire_reservations(other, now=later))

        expirer = threading.Thread(target=expire)
        expirer.start()
        expirer.join(30)
        assert done == [2], "expire_reservations waited for the locked row (or failed)"
    assert services.expire_reservations(session, now=later) == 1  # taken by the next run
    assert seats_taken(pg, event) == 0


# -- command line --------------------------------------------------------------------------------

def ticketflow_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PGBROKER_DATABASE_URL"}
    environ["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "ticketflow", *args], cwd=REPO_ROOT,
                          env={**environ, **env}, capture_output=True, text=True, timeout=120,
                          check=False)


def test_migrate_applies_both_schemas_once(db_url: str, pg: psycopg.Connection) -> None:
    done = ticketflow_cli("migrate", "--database-url", db_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["pgbroker: up to date", "ticketflow: applied [1, 2]"]
    assert count(pg, "events") == 0  # the tables exist
    again = ticketflow_cli("migrate", "--database-url", db_url)
    assert again.stdout.splitlines()[-1] == "ticketflow: up to date"


@pytest.mark.parametrize("args, env, status, message", [
    (["migrate", "--database-url", "postgresql://postgres@127.0.0.1:1/nowhere"], {}, 1,
     "cannot connect to PostgreSQL"),
    (["migrate", "--database-url", "mysql://db/app"], {}, 2, "not a PostgreSQL URL"),
    (["demo", "--short"], {"PGBROKER_DATABASE_URL": "http://db/app"}, 2, "not a PostgreSQL URL"),
    (["demo", "--short"], {"PGBROKER_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/x"}, 1,
     "cannot connect to PostgreSQL"),
])
def test_the_commands_explain_a_database_they_cannot_use(
        args: list[str], env: dict[str, str], status: int, message: str) -> None:
    done = ticketflow_cli(*args, **env)
    assert done.returncode == status, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "Started worker" not in done.stdout
