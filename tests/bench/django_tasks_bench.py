"""Throughput of Django tasks per worker process: pgbroker's ``django.tasks`` backend against
django-tasks-db's (the ORM backend the django-tasks backport points to), side by side, same
database, same task (``tests.apps.django_project.shop.jobs.noop``), in one run.

``python -m tests.bench.django_tasks_bench [--tasks N]``: a fresh database, N tasks enqueued
per backend first, then ONE worker process drains them -- ``celery worker -P solo`` for
pgbroker, ``manage.py db_worker`` for django-tasks-db -- and the window from the first start to
the last finish, read from each backend's own timestamps in the database (process start-up
excluded), gives tasks/s. Prints the figures and the ratio (figures, not a timed test).
django-ox is not measured: it needs Django 6 (Python 3.12), which this machine lacks.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psycopg

from pgbroker._pg.local_server import admin_url, resolve_database_url
from tests.support.databases import create_database, drop_database
from tests.support.processes import REPO_ROOT

SETTINGS = "tests.bench.django_tasks_settings"
ENQUEUE = """
from django.db import transaction
from tests.apps.django_project.shop.jobs import noop
task = noop.using(backend={backend!r})
for start in range(0, {n}, 1000):
    with transaction.atomic():
        for i in range(start, min(start + 1000, {n})):
            task.enqueue(i)
"""
#: The window of each backend's runs: (first start, last finish, finished count).
WINDOWS = {
    "default": "SELECT min(locked_at), max(updated_at), count(*) FILTER (WHERE state ="
               " 'completed') FROM pgbroker.jobs",
    "db": "SELECT min(started_at), max(finished_at), count(*) FILTER (WHERE status ="
          " 'SUCCESSFUL') FROM django_tasks_database_dbtaskresult",
}
WORKERS = {
    "default": [sys.executable, "-m", "celery", "-A", "tests.apps.django_project.celery", "worker",
                "-P", "solo", "--prefetch-multiplier", "32", "-l", "WARNING"],
    "db": [sys.executable, "-m", "django", "db_worker", "--backend", "db", "--interval", "0.1",
           "--no-startup-delay", "-v", "0"],
}


def _run(env: dict[str, str], *argv: str) -> None:
    done = subprocess.run([sys.executable, "-m", "django", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(done.stderr)


def measure(url: str, env: dict[str, str], backend: str, n: int) -> float:
    """Tasks per second of one worker process of ``backend`` draining ``n`` tasks."""
    _run(env, "shell", "-c", ENQUEUE.format(backend=backend, n=n))
    worker = subprocess.Popen(WORKERS[backend], cwd=REPO_ROOT, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with psycopg.connect(url, autocommit=True) as pg:
            deadline = time.monotonic() + 1800
            while (row := pg.execute(WINDOWS[backend]).fetchone())[2] < n:
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise SystemExit(f"{backend}: {row[2]} of {n} done")
                time.sleep(0.5)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(60)
    return n / (row[1] - row[0]).total_seconds()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=5000, help="tasks per backend")
    args = parser.parse_args(argv)
    server = resolve_database_url("bench")
    name = f"pgbroker_bench_djtasks_{os.getpid()}"
    create_database(server, name)
    url = admin_url(server, name)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "PGBROKER_DATABASE_URL": url,
           "PYTHONPATH": str(REPO_ROOT)}
    try:
        _run(env, "migrate", "-v", "0")
        ours = measure(url, env, "default", args.tasks)
        theirs = measure(url, env, "db", args.tasks)
    finally:
        drop_database(server, name)
    print(f"{args.tasks} tasks per backend, one worker process each, same database and task:")
    print(f"  pgbroker (celery worker -P solo): {ours:8.1f} tasks/s")
    print(f"  django-tasks-db (db_worker):      {theirs:8.1f} tasks/s")
    print(f"  ratio pgbroker / django-tasks-db: {ours / theirs:8.2f}")


if __name__ == "__main__":
    main()
