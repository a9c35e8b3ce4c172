"""End to end: ticketflow in real ``celery -A ticketflow worker`` and ``celery -A ticketflow beat``
processes (celeryconfig.py at the repository root, pointed at the test's database through
``PGBROKER_DATABASE_URL``), and the demo, ``python -m ticketflow demo``, as a newcomer runs it.

What is checked comes from the database (job rows, payments, e-mails), never from timing: the
delays printed with ``[figure]`` are for reading (``pytest -s``), not asserted.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.orm import Session

from pgbroker._pg.local_server import admin_url
from tests.support.databases import drop_database
from tests.support.processes import REPO_ROOT, run_beat, wait_for
from tests.support.tickets import (
    confirmed,
    held,
    jobs_of,
    rows,
    seats_taken,
    start_worker,
)
from ticketflow import services, tasks
from ticketflow.schedule import ENV_EXPIRE_INTERVAL

def states(pg: psycopg.Connection, table: str) -> dict[int, str]:
    return {r["id"]: r["state"] for r in rows(pg, f"SELECT id, state FROM ticketflow.{table}")}


def wake(pg: psycopg.Connection, queue: str) -> None:
    """The NOTIFY a publish sends: the worker claims now rather than at its next poll."""
    pg.execute("SELECT pg_notify('pgbroker.jobs', '0 ' || %s)", (queue,))


# -- beat: expiry --------------------------------------------------------------------------------

def test_holds_past_their_deadline_expire_at_the_next_beat_run(
        tf_url: str, session: Session, event: int, pg: psycopg.Connection,
        broker_url: str) -> None:
    due = [held(session, event, seats=2, hold=1) for _ in range(3)]
    kept_hold = held(session, event, hold=3600)
    kept = confirmed(session, event)
    start_worker(broker_url)
    beat = run_beat("ticketflow", broker_url, env={ENV_EXPIRE_INTERVAL: "2"})

    wait_for(lambda: all(states(pg, "reservations")[rid] == "expired" for rid in due), 90,
             message=lambda: f"the expiry of {due}: {states(pg, 'reservations')}\n{beat.log()}")
    assert states(pg, "reservations") == {**{rid: "expired" for rid in due},
                                          kept_hold: "held", kept: "confirmed"}
    assert seats_taken(pg, event) == 2  # the six seats of the expired holds are free again
    late = rows(pg, "SELECT expired_at - hold_expires_at AS late FROM ticketflow.reservations"
                    " WHERE state = 'expired'")
    assert all(r["late"].total_seconds() >= 0 for r in late)  # never before the deadline
    # The expiries were done by beat's jobs: each occurrence keyed beat:<entry>:<occurrence>.
    # the run that expired them acks its job a moment after its transaction commits
    runs = wait_for(lambda: (found := jobs_of(pg, "expire_reservations"))
                    and any(j["state"] == "completed" for j in found) and found, 30,
                    message="a completed expiry job")
    assert all(j["idempotency_key"].startswith("beat:expire-reservations:") for j in runs)
    print(f"\n[figure] expired after the deadline by at most "
          f"{max(r['late'].total_seconds() for r in late):.1f} s (beat every 2 s)")


# -- e-mail: exactly once ------------------------------------------------------------------------

def test_a_confirmation_email_delivered_twice_is_sent_once(
        tf_url: str, session: Session, event: int, pg: psycopg.Connection,
        broker_url: str) -> None:
    rid = confirmed(session, event)  # job 1, written in the confirming transaction
    tasks.send_confirmation_email.delay(rid)  # job 2: the same task published again
    worker = start_worker(broker_url)
    wait_for(lambda: [j["state"] for j in jobs_of(pg, "send_confirmation_email")]
             == ["completed", "completed"], 60, message="both e-mail jobs to run")

    # And a redelivery of the first job (as after a worker lost mid-task): back to pending.
    first = jobs_of(pg, "send_confirmation_email")[0]
    pg.execute("UPDATE pgbroker.jobs SET state = 'pending', locked_by = NULL, locked_at = NULL"
               " WHERE id = %s", (first["id"],))
    wake(pg, "email")
    wait_for(lambda: [(j["state"], j["attempts"]) for j in jobs_of(pg, "send_confirmation_email")
                      if j["id"] == first["id"]] == [("completed", 2)], 60,
             message="the redelivery to run")

    assert rows(pg, "SELECT reservation_id, kind FROM ticketflow.sent_emails") == [
        {"reservation_id": rid, "kind": "confirmation"}]
    assert worker.log().count(f"confirmation e-mail of reservation {rid} already sent") == 2


# -- payments: retries with backoff, dead letters ------------------------------------------------

def test_payments_retry_transient_failures_with_backoff_and_dead_letter_the_rest(
        tf_url: str, session: Session, event: int, pg: psycopg.Connection,
        broker_url: str) -> None:
    flaky = services.pay(session, confirmed(session, event), "transient-2")
    declined = services.pay(session, confirmed(session, event), "declined")
    hopeless = services.pay(session, confirmed(session, event), "transient-99")
    start_worker(broker_url)

    def settled() -> bool:  # the payments final, and so the jobs (acked after on_failure)
        return "pending" not in states(pg, "payments").values() and all(
            j["state"] in ("completed", "dead") for j in jobs_of(pg, "charge_payment"))

    wait_for(settled, 120, message=lambda: f"every payment to end: {states(pg, 'payments')}")
    payments = {r["id"]: r for r in rows(pg, "SELECT * FROM ticketflow.payments")}

    # transient-2: two gateway timeouts, two Celery retries (new job rows), then success
    assert payments[flaky.id]["state"] == "succeeded"
    assert payments[flaky.id]["gateway_calls"] == 3
    charges = [j for j in jobs_of(pg, "charge_payment") if j["arg"] == flaky.id]
    assert [(j["retries"], j["state"]) for j in charges] == [
        (0, "completed"), (1, "completed"), (2, "completed")]
    calls = rows(pg, "SELECT call, outcome, at FROM ticketflow.payment_attempts"
                     " WHERE payment_id = %s ORDER BY call", flaky.id)
    assert [c["outcome"] for c in calls] == ["transient", "transient", "succeeded"]
    delays = []
    for retry, failed, call in zip(charges[1:], calls, calls[1:]):
        # The wait the worker chose is run_at - (the moment it decided to retry), a moment no
        # row records: it came after the failed gateway call and before the retry's row was
        # written. So the wait lies between run_at - created_at and run_at - the failed call's
        # time, whatever the load makes of the publish (run_at - created_at alone came out short:
        # 0.31 s for a 0.35 s bound on a loaded machine).
        at_least = (retry["run_at"] - retry["created_at"]).total_seconds()
        at_most = (retry["run_at"] - failed["at"]).total_seconds()
        delays.append((at_least, at_most))
        # the table of waits (FAST_PDF's short one), 20 % jitter either way (not Celery's
        # default retry delay of 3 minutes), and the retry did not run before it
        table = (0.5, 1, 2, 4)[retry["retries"] - 1]
        assert at_least <= table * 1.2 + 0.05 and at_most >= table * 0.8 - 0.05, (
            at_least, at_most)
        assert call["at"] >= retry["run_at"]
    wait_for(lambda: rows(pg, "SELECT reservation_id FROM ticketflow.tickets") == [
        {"reservation_id": flaky.reservation_id}], 60, message="the PDF ticket")

    # declined: permanent, not retried; the job is a dead letter with its error
    [dead] = [j for j in jobs_of(pg, "charge_payment") if j["arg"] == declined.id]
    assert dead["state"] == "dead" and dead["retries"] == 0
    assert "PaymentDeclined" in dead["last_error"] and "card declined" in dead["last_error"]
    assert payments[declined.id]["state"] == "failed"
    assert payments[declined.id]["gateway_calls"] == 1
    assert payments[declined.id]["last_error"].startswith("PaymentDeclined: card declined")

    # transient-99: retried max_retries times, then the last failure is a dead letter
    given_up = [j for j in jobs_of(pg, "charge_payment") if j["arg"] == hopeless.id]
    assert [j["retries"] for j in given_up] == list(range(tasks.CHARGE_MAX_RETRIES + 1))
    assert [j["state"] for j in given_up] == ["completed"] * tasks.CHARGE_MAX_RETRIES + ["dead"]
    assert "TransientPaymentError" in given_up[-1]["last_error"]
    assert payments[hopeless.id]["state"] == "failed"
    assert payments[hopeless.id]["gateway_calls"] == tasks.CHARGE_MAX_RETRIES + 1
    print("\n[figure] charge retry delays (table of waits with jitter): "
          + ", ".join(f"{low:.2f}-{high:.2f} s" for low, high in delays))


# -- the slow task's time limits -----------------------------------------------------------------

def test_a_pdf_render_over_its_soft_time_limit_ends_dead_with_the_error(
        tf_url: str, session: Session, event: int, pg: psycopg.Connection,
        broker_url: str) -> None:
    rid = confirmed(session, event)
    start_worker(broker_url, env={tasks.ENV_PDF_SECONDS: "60"})
    tasks.render_ticket_pdf.apply_async((rid,), soft_time_limit=1, time_limit=30)
    [job] = wait_for(lambda: [j for j in jobs_of(pg, "render_ticket_pdf")
                              if j["state"] not in ("pending", "running")], 60,
                     message="the render to end")
    assert job["state"] == "dead" and "SoftTimeLimitExceeded" in job["last_error"]
    assert rows(pg, "SELECT * FROM ticketflow.tickets") == []


# -- the demo ------------------------------------------------------------------------------------

def run_demo(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ticketflow", "demo", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)


def demo_env(**extra: str) -> dict[str, str]:
    """The environment of a newcomer's shell: the venv's bin is not on PATH (the README never
    activates it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PGBROKER_DATABASE_URL", ENV_EXPIRE_INTERVAL, tasks.ENV_PDF_SECONDS)}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and p != venv_bin)
    return {**env, **extra}


_names = itertools.count(1)


@pytest.fixture
def server_url(empty_url: str) -> str:
    """The database PGBROKER_DATABASE_URL names for the demo: empty, and it must stay so."""
    return empty_url


@pytest.fixture
def demo_db(database_url: str) -> Iterator[str]:
    """A name for the demo's own database, dropped after the test if the demo kept it."""
    name = f"pgbroker_test_demo_{os.getpid()}_{next(_names)}"
    try:
        yield name
    finally:
        drop_database(database_url, name)


def databases(server_url: str) -> set[str]:
    with psycopg.connect(server_url) as conn:
        return {r[0] for r in conn.execute("SELECT datname FROM pg_database")}


def schemas(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace")}


def final_counts(output: str) -> dict[str, int]:
    """The numbers of the demo's 'Final counts' block, as {'<line> <word>': n}."""
    assert "Final counts" in output, output
    block = output.split("Final counts", 1)[1]
    counts: dict[str, int] = {}
    for line in block.splitlines()[1:]:
        if line.startswith("  dead letter:") or not line.startswith("  "):
            break
        label, total, rest = re.match(r"\s+(\S+(?: \S+)?)\s+(\d+)(.*)", line).groups()
        counts[label] = int(total)
        for word, number in re.findall(r"([a-z]+(?: [a-z]+)?) (\d+)", rest):
            counts[f"{label} {word}"] = int(number)
    return counts


def children_gone(output: str) -> None:
    """The worker and beat the demo started, and the worker's pool, have all exited."""
    pids = [int(p) for p in re.findall(r"Started worker \(pid (\d+)\) and beat \(pid (\d+)\)",
                                       output)[0]]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # no process left in its group
        assert re.search(rf"\(pid {pid}\) exited with status 0", output), output


def test_the_short_demo_runs_to_completion_and_prints_its_counts(
        server_url: str, demo_db: str, tmp_path: Path) -> None:
    env = demo_env(PGBROKER_DATABASE_URL=server_url)
    done = run_demo("--short", "--log-dir", str(tmp_path), "--database", demo_db, "--keep",
                    env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # its own database, kept as asked; nothing written where PGBROKER_DATABASE_URL points
    assert {"ticketflow", "pgbroker"}.isdisjoint(schemas(server_url))
    url = admin_url(server_url, demo_db)
    assert f"kept database {demo_db}" in done.stdout
    counts = final_counts(done.stdout)
    # what it printed is what the database holds
    with psycopg.connect(url) as pg:
        reservations = dict(pg.execute("SELECT state, count(*) FROM ticketflow.reservations"
                                       " GROUP BY state").fetchall())
        seats = pg.execute("SELECT sum(seats) FILTER (WHERE state IN ('held', 'confirmed')),"
                           " (SELECT seats_taken FROM ticketflow.events) "
                           "FROM ticketflow.reservations").fetchone()
        emailed = pg.execute("SELECT count(DISTINCT reservation_id) FROM ticketflow.sent_emails"
                             ).fetchone()[0]
    assert counts["reservations"] == 200 == sum(reservations.values())
    assert counts["reservations held"] == 0 and "held" not in reservations
    assert counts["reservations expired"] == reservations["expired"] == 40
    assert counts["reservations confirmed"] == reservations["confirmed"] == 160
    # seats: the event's counter is the seats of the reservations still holding theirs
    assert counts["seats"] == seats[0] == seats[1] and counts["seats of"] == 600
    assert "expired holds gave theirs back" in done.stdout
    assert counts["e-mails sent"] == 160 == emailed
    assert counts["payments failed"] == 1 and counts["payments pending"] == 0
    assert counts["tickets"] == counts["payments succeeded"]
    assert counts["dead letters"] == 1 == counts["jobs dead"]
    assert counts["jobs retries"] > 0
    assert "dead letter: ticketflow.tasks.charge_payment: PaymentDeclined" in done.stdout
    assert "pgbroker serve" in done.stdout and "/metrics" in done.stdout
    children_gone(done.stdout)

    # the "in another terminal" hint works as printed, in the same shell (no venv on PATH)
    [hint] = [line for line in done.stdout.splitlines()
              if " stats --database-url " in line and "queues:" in line]
    command = hint.split("   ")[0].strip()
    stats = subprocess.run(shlex.split(command), cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert stats.returncode == 0, (command, stats.stderr)
    assert re.search(r"^email\s", stats.stdout, re.M), stats.stdout
    assert f"/{demo_db}, schema pgbroker" in stats.stderr


def as_from_a_terminal() -> None:
    """Give the child the SIGINT disposition of a terminal's foreground job. A shell without job
    control starts background commands (``.ci/run &``) with SIGINT ignored, children inherit that,
    and Python then installs no KeyboardInterrupt handler: Ctrl-C would be ignored, rightly."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_demo_and_its_worker_and_beat_cleanly_and_drops_its_database(
        server_url: str, demo_db: str, tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "ticketflow", "demo", "--log-dir", str(tmp_path), "--database",
         demo_db], cwd=REPO_ROOT,
        env=demo_env(PGBROKER_DATABASE_URL=server_url), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=as_from_a_terminal)
    try:
        lines: list[str] = []
        for line in demo.stdout:  # the first live refresh: reservations are being made
            lines.append(line)
            if "e-mails sent" in line:
                break
        # Ctrl-C once the worker and beat run (before, SIGTERM's default action ends them)
        logs = {name: tmp_path / f"{name}.log" for name in ("worker", "beat")}
        wait_for(lambda: "ready." in logs["worker"].read_text(), 60, message="worker ready")
        wait_for(lambda: "beat: Starting" in logs["beat"].read_text(), 60, message="beat up")
        demo.send_signal(signal.SIGINT)
        output = "".join(lines) + demo.communicate(timeout=90)[0]
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, output
    assert "Ctrl-C: stopping the worker and beat" in output
    children_gone(output)
    assert "Warm shutdown" in logs["worker"].read_text()
    assert demo_db not in databases(server_url) and f"dropped database {demo_db}" in output
    assert {"ticketflow", "pgbroker"}.isdisjoint(schemas(server_url))


def test_the_demo_starts_an_embedded_server_when_there_is_no_other(tmp_path: Path) -> None:
    pytest.importorskip("pgserver")
    done = run_demo("--short", "--reservations", "30", "--log-dir", str(tmp_path),
                    env=demo_env(PGBROKER_EMBEDDED="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "an embedded PostgreSQL server" in done.stdout
    counts = final_counts(done.stdout)
    assert counts["reservations"] == 30 and counts["reservations held"] == 0
    assert counts["e-mails sent"] == counts["reservations confirmed"]
    # the children used the embedded server's socket, which the demo stopped and removed
    socket_dir = re.search(r"\?host=([^&\s)]+)", done.stdout)[1]
    assert not Path(socket_dir).exists()
    children_gone(done.stdout)
