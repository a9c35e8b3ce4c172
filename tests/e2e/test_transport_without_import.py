"""A project that changes only ``broker_url``: its app module never imports pgbroker, and the
``celery`` command line still finds the ``pgbroker://`` transport (pgbroker's Celery CLI plugin,
``celery.commands``, loaded by Celery at start): ``celery call`` publishes, ``celery worker``
runs it, ``celery pgbroker`` reads the queue. A plain Python producer still needs the import
(or pgbroker's Django app): kombu says so in its own words, and the README says how."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

from tests.support.processes import run_worker, wait_for

PLAIN_APP = '''\
"""A Celery app that never imports pgbroker."""
import os
from celery import Celery

app = Celery("plainapp", broker=os.environ["PGBROKER_TEST_BROKER_URL"])


@app.task(name="plainapp.add")
def add(x, y):
    return x + y
'''


def _run(tmp_path: Path, broker_url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PGBROKER_TEST_BROKER_URL": broker_url, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_celery_commands_find_the_transport_without_an_import(
        tmp_path: Path, broker_url: str, pg: psycopg.Connection) -> None:
    (tmp_path / "plainapp.py").write_text(PLAIN_APP)
    call = _run(tmp_path, broker_url, "-m", "celery", "-A", "plainapp", "call", "plainapp.add",
                "--args", "[1, 2]")
    assert call.returncode == 0, call.stderr
    assert pg.execute("SELECT task, state FROM pgbroker.jobs").fetchall() == [
        ("plainapp.add", "pending")]

    stats = _run(tmp_path, broker_url, "-m", "celery", "-A", "plainapp", "pgbroker", "stats",
                 "--json")
    assert stats.returncode == 0, stats.stderr
    assert "from the Celery app plainapp" in stats.stderr
    [celery_queue] = [q for q in json.loads(stats.stdout)["queues"] if q["queue"] == "celery"]
    assert celery_queue["pending"] == 1

    worker = run_worker("plainapp", broker_url, env={"PYTHONPATH": str(tmp_path)})
    worker.wait_ready(60)
    wait_for(lambda: pg.execute("SELECT state FROM pgbroker.jobs").fetchone()[0] == "completed",
             60, message="the job run by a worker whose app never imported pgbroker")

    # a plain producer, outside Celery's command line: the import is needed (README)
    plain = _run(tmp_path, broker_url, "-c", "import plainapp; plainapp.add.delay(1, 2)")
    assert plain.returncode != 0 and "No such transport: pgbroker" in plain.stderr
