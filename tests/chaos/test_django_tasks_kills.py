"""Django tasks (``django.tasks`` on pgbroker's backend) while workers are SIGKILLed every
20-45 s, as django-ox's published soak kills its workers: every task completes, none is lost,
and a task runs twice only if it was in a killed worker's hands (its job was redelivered).

``PGBROKER_SOAK_TASKS`` tasks (default 3,000; each sleeps 50 ms and writes a row) go through
two workers (``-c 4``) of the test project (``tests/apps/django_project``, ``settings_atomic``)
while, every 20-45 s, one worker's main process is SIGKILLed, then its orphaned pool children (as a
supervisor would), and a new one started. Counts are printed (``pytest -s``); minutes long,
hence ``slow``: ``pytest -m slow -s tests/chaos/test_django_tasks_kills.py``. The figures of a
run are in docs/django.md.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from tests.support.processes import REPO_ROOT, WorkerProcess, run_worker

TASKS = int(os.environ.get("PGBROKER_SOAK_TASKS", "3000"))
SETTINGS = "tests.apps.django_project.settings_atomic"
ENQUEUE = f"""
from django.db import transaction
from tests.apps.django_project.shop.jobs import record
for start in range(0, {TASKS}, 500):
    with transaction.atomic():
        for n in range(start, min(start + 500, {TASKS})):
            record.enqueue(n, 0.05)
"""


def _worker(url: str) -> WorkerProcess:
    return run_worker("tests.apps.django_project.celery", "pgbroker+" + url, "-c", "4",
                      env={"DJANGO_SETTINGS_MODULE": SETTINGS})


def _counts(pg: psycopg.Connection) -> tuple[int, int]:
    """(distinct tasks run, jobs completed)."""
    return pg.execute("SELECT (SELECT count(DISTINCT n) FROM public.soak_runs),"
                      " (SELECT count(*) FROM pgbroker.jobs WHERE state = 'completed')"
                      ).fetchone()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_django_tasks_survive_a_worker_sigkilled_every_20_to_45_s(empty_url: str) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "PGBROKER_DATABASE_URL": empty_url,
           "PYTHONPATH": str(REPO_ROOT)}
    for argv in (["migrate", "-v", "0"], ["shell", "-c", ENQUEUE]):
        done = subprocess.run([sys.executable, "-m", "django", *argv], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    with psycopg.connect(empty_url, autocommit=True) as pg:
        pg.execute("CREATE TABLE public.soak_runs (n int NOT NULL, pid int NOT NULL,"
                   " at timestamptz NOT NULL DEFAULT clock_timestamp())")
        workers = [_worker(empty_url), _worker(empty_url)]
        rng = random.Random(20)
        kills, started = 0, time.monotonic()
        while _counts(pg) != (TASKS, TASKS) and time.monotonic() - started < 1800:
            deadline = time.monotonic() + rng.uniform(20, 45)
            while time.monotonic() < deadline and _counts(pg) != (TASKS, TASKS):
                time.sleep(0.5)  # the scenario: the next kill 20-45 s on, unless all are done
            if _counts(pg) == (TASKS, TASKS):
                break
            victim = workers[kills % 2]
            victim.kill(signal.SIGKILL)  # the main process only
            victim.wait(10)
            time.sleep(0.5)  # the scenario: the pool children outlive their parent a while
            victim.kill_group(signal.SIGKILL)  # then its orphaned pool children
            workers[kills % 2] = _worker(empty_url)
            kills += 1
        elapsed = time.monotonic() - started
        assert _counts(pg) == (TASKS, TASKS), "every task completed, none lost"
        twice = pg.execute(  # the tasks run more than once, with their job's deliveries
            "WITH dup AS (SELECT n, count(*) AS runs FROM public.soak_runs GROUP BY n"
            "             HAVING count(*) > 1)"
            " SELECT d.n, d.runs, (SELECT max(j.attempts) FROM pgbroker.jobs AS j"
            "   WHERE convert_from(j.body, 'UTF8') LIKE '%[' || d.n || ', 0.05]%') FROM dup AS d"
            ).fetchall()
        redelivered = pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE attempts > 1"
                                 ).fetchone()[0]
        print(f"\n{TASKS} Django tasks, {kills} worker SIGKILLs every 20-45 s, {elapsed:.0f} s: "
              f"all completed, {redelivered} redelivered, {len(twice)} ran twice")
        assert kills >= 1
        # a task ran twice only if its job was redelivered: it was in a killed worker's hands
        assert all(attempts > 1 for _, _, attempts in twice), twice
