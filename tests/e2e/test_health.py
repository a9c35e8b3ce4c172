"""``pgbroker health worker|queue|beat`` against real workers and a real beat: healthy is exit 0,
stale is 3, missing is 4, each with one line of JSON saying why.

The beat check is seed 004's alert ("alert when the expiry task has not run for 5 minutes"):
ticketflow's ``expire-reservations`` entry, every second here, is on time while beat runs and
overdue once it stops.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgbroker.cli import main
from tests.support.control import node
from tests.support.workers import start_worker
from tests.support.tickets import start_worker as start_ticketflow_worker
from tests.support.processes import run_beat, wait_for
from tests.support.db import add_job
from ticketflow.schedule import ENV_EXPIRE_INTERVAL

Health = Callable[..., tuple[int, dict[str, Any]]]


@pytest.fixture
def health(db_url: str, capsys: pytest.CaptureFixture[str]) -> Health:
    """``health("worker", "--pid", "1")`` -> (exit status, the JSON line as a dict)."""

    def run(*args: str) -> tuple[int, dict[str, Any]]:
        capsys.readouterr()
        code = main(["--database-url", db_url, "health", *args])
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out  # one line
        return code, json.loads(out)

    return run


def until(health: Health, code: int, *args: str,
          also: Callable[[dict[str, Any]], bool] = lambda verdict: True) -> dict[str, Any]:
    """Run the check until it exits with ``code`` (and its verdict passes ``also``)."""
    found = wait_for(lambda: (r := health(*args))[0] == code and also(r[1]) and r, 60,
                     message=f"health {' '.join(args)} to exit {code}")
    return found[1]


def test_a_worker_is_alive_then_stale_when_frozen_then_gone_when_killed(
        broker_url: str, health: Health) -> None:
    # a lease of its own (stored in its row: 0016), by which every check judges it
    worker = start_worker(broker_url, "-c", "1",
                          options={"heartbeat_interval": 0.5, "lease_timeout": 2})
    pid = str(worker.pid)
    code, verdict = health("worker", "--pid", pid)
    assert (code, verdict["check"], verdict["status"]) == (0, "worker", "ok"), verdict
    assert [c["pid"] for c in verdict["consumers"]] == [worker.pid]
    assert health("worker", "--node", node(worker))[0] == 0  # as Celery names it
    assert health("worker", "--consumer", verdict["consumers"][0]["id"])[0] == 0

    code, verdict = health("worker", "--pid", "1")
    assert (code, verdict["status"]) == (4, "missing")
    assert "no consumer of host" in verdict["reason"] and "pid 1" in verdict["reason"]

    worker.kill(signal.SIGSTOP)  # frozen: no heartbeat
    try:
        verdict = until(health, 3, "worker", "--pid", pid)
    finally:
        worker.kill(signal.SIGCONT)
    assert verdict["status"] == "stale" and "over its 2 s lease" in verdict["reason"]
    until(health, 0, "worker", "--pid", pid)  # it heartbeats again

    worker.kill_group(signal.SIGKILL)
    worker.wait(30)
    verdict = until(health, 3, "worker", "--pid", pid)  # its row stays until a sweeper runs
    assert "its database session is gone" in verdict["reason"], verdict


def test_a_queue_is_ready_until_its_oldest_job_waits_too_long(
        broker_url: str, db_url: str, pg: psycopg.Connection, health: Health) -> None:
    start_worker(broker_url, "-Q", "hq", "-c", "1")
    code, verdict = health("queue", "hq")
    assert (code, verdict["status"], verdict["consumers_alive"]) == (0, "ok", 1), verdict
    code, verdict = health("queue", "hq", "--min-consumers", "2")
    assert (code, verdict["status"]) == (4, "missing"), verdict
    code, verdict = health("queue", "nowhere")
    assert (code, verdict["reason"]) == (4, "unknown queue 'nowhere': no consumer, no job")

    assert main(["--database-url", db_url, "pause", "hq"]) == 0  # the job below must wait
    add_job(pg, "pending", queue="hq", run_at=pg.execute(
        "SELECT now() - interval '10 minutes'").fetchone()[0])
    code, verdict = health("queue", "hq")
    assert (code, verdict["status"]) == (3, "stale"), verdict
    assert verdict["reason"].startswith("the oldest due job of queue 'hq' has waited 600 s")
    assert verdict["reason"].endswith("over 300 s (the queue is paused)")
    assert health("queue", "hq", "--max-pending-age", "900")[0] == 0


def test_beat_is_on_time_while_it_runs_and_overdue_once_it_stops(
        tf_url: str, broker_url: str, health: Health) -> None:
    start_ticketflow_worker(broker_url)
    beat = run_beat("ticketflow", broker_url, env={ENV_EXPIRE_INTERVAL: "1"})
    check = ("beat", "--entry", "expire-reservations", "--grace", "2")
    # missing until beat has written its entries, then on time (nothing owed, then runs done)
    until(health, 0, *check)
    verdict = until(health, 0, *check,
                    also=lambda v: v["entries"][0]["last_completed_age"] is not None)
    assert verdict["entries"][0]["entry"] == "expire-reservations"
    code, verdict = health("beat", "--entry", "no-such-entry")
    assert (code, verdict["reason"]) == (4, "beat entry 'no-such-entry': no such entry")

    beat.stop()  # expire_reservations stops running: the alert of seed 004
    verdict = until(health, 3, *check)
    assert verdict["status"] == "stale"
    assert verdict["reason"].startswith("1 beat entry overdue: expire-reservations (last "
                                        "completed run: "), verdict
    assert health("beat", "--entry", "expire-reservations", "--grace", "600")[0] == 0
