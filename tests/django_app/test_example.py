"""The Django example (``examples/django``: TicketFlow's reservations on Django) as its users
run it: ``manage.py test`` with and without Celery's eager mode, and the project on a real
worker and beat -- the e-mail and the charge enqueued inside ``confirm``'s ``atomic()``, the
reservations expired by beat -- with a project that never imports pgbroker for its broker."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from tests.support.processes import REPO_ROOT, run_beat, run_worker, wait_for

EXAMPLE = REPO_ROOT / "examples" / "django"


def _env(db_url: str, **extra: str) -> dict[str, str]:
    return {"DATABASE_URL": db_url, "PYTHONPATH": str(EXAMPLE), **extra}


def manage(db_url: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=EXAMPLE,
                          env={**os.environ, **_env(db_url, **extra)}, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("eager", ["", "1"])
def test_manage_py_test_passes(empty_url: str, eager: str) -> None:
    done = manage(empty_url, "test", "--noinput", CELERY_TASK_ALWAYS_EAGER=eager)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ran 7 tests" in done.stderr and "OK" in done.stderr


def test_the_project_on_a_worker_and_beat(empty_url: str) -> None:
    assert manage(empty_url, "migrate", "-v", "0").returncode == 0
    past = datetime.now(timezone.utc) - timedelta(minutes=1)
    with psycopg.connect(empty_url, autocommit=True) as pg:
        for ref, expires in (("R-1", past + timedelta(hours=1)), ("R-old", past)):
            pg.execute("INSERT INTO reservations_reservation (ref, email, amount_cents, status,"
                       " expires_at) VALUES (%s, 'a@example.com', 4200, 'held', %s)",
                       (ref, expires))
        shell = manage(empty_url, "shell", "-c",
                       "from reservations.services import confirm; confirm('R-1')")
        assert shell.returncode == 0, shell.stderr
        env = _env(empty_url, EXPIRE_EVERY_SECONDS="1")
        run_worker("ticketsite", "pgbroker+" + empty_url, env=env).wait_ready(60)
        run_beat("ticketsite", "pgbroker+" + empty_url, env=env)

        def done() -> bool:
            return pg.execute(
                "SELECT (SELECT count(*) FROM reservations_sentemail WHERE ref = 'R-1'),"
                " (SELECT count(*) FROM reservations_charge),"
                " (SELECT status FROM reservations_reservation WHERE ref = 'R-old')"
            ).fetchone() == (1, 1, "expired")

        wait_for(done, 90, message="the e-mail sent, the charge made, R-old expired by beat")
