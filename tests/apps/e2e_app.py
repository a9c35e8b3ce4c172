"""The Celery app the end-to-end and chaos tests run in real ``celery worker`` processes.

Every task records each run in ``public.runs`` of the test database, so a test can count runs
(duplicates, losses) with SQL instead of trusting the worker's log.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psycopg
from celery import Celery

import pgbroker  # noqa: F401 - registers pgbroker://
from pgbroker._pg.local_server import normalize_url

BROKER_URL = os.environ.get("PGBROKER_TEST_BROKER_URL", "pgbroker://postgres@127.0.0.1/postgres")
#: Where tasks record their runs: the broker's database, or PGBROKER_TEST_RUNS_URL when the
#: broker URL is not one libpq URL (kombu's ``a;b`` alternates in tests/chaos/test_failover.py).
DB_URL = os.environ.get("PGBROKER_TEST_RUNS_URL") or normalize_url(BROKER_URL)

#: The settings every test app's workers run with: acks late, one job at a time, and the
#: transport options a test passes in PGBROKER_TEST_TRANSPORT_OPTIONS.
WORKER_CONF = dict(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options=json.loads(os.environ.get("PGBROKER_TEST_TRANSPORT_OPTIONS", "{}")),
)

app = Celery("e2eapp", broker=BROKER_URL)
app.conf.update(WORKER_CONF, worker_cancel_long_running_tasks_on_connection_loss=False)

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS public.runs (
    n serial PRIMARY KEY,
    task text NOT NULL,
    key text NOT NULL,
    pid integer NOT NULL,
    retries integer NOT NULL DEFAULT 0,
    redelivered boolean,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

_conn: tuple[int, psycopg.Connection] | None = None


def _db() -> psycopg.Connection:
    global _conn
    if _conn is None or _conn[0] != os.getpid() or _conn[1].closed:
        _conn = (os.getpid(), psycopg.connect(DB_URL, autocommit=True))
    return _conn[1]


def record(task, key: str) -> None:
    req = task.request
    _db().execute(
        "INSERT INTO public.runs (task, key, pid, retries, redelivered)"
        " VALUES (%s, %s, %s, %s, %s)",
        (task.name.rsplit(".", 1)[-1], key, os.getpid(), req.retries or 0,
         (req.delivery_info or {}).get("redelivered")),
    )


@app.task(bind=True)
def touch(self, key: str) -> str:
    record(self, key)
    return key


@app.task(bind=True)
def add(self, x: int, y: int) -> int:
    record(self, f"add:{x}:{y}")
    return x + y


@app.task(bind=True)
def nap(self, key: str, seconds: float) -> str:
    record(self, key)
    time.sleep(seconds)  # the task's body: a task that runs this long
    record(self, key + ":done")
    return key


@app.task(bind=True)
def hold(self, key: str) -> str:
    """Runs until the test records a run of ``<key>:go``: a task whose end the test decides."""
    record(self, key)
    while not _db().execute("SELECT 1 FROM public.runs WHERE key = %s", (key + ":go",)).fetchone():
        time.sleep(0.05)
    record(self, key + ":done")
    return key


@app.task(bind=True)
def suicide(self, key: str) -> None:
    """A poison task: kills the pool process running it, every time."""
    record(self, key)
    os.kill(os.getpid(), signal.SIGKILL)


class Transient(Exception):
    pass


@app.task(bind=True, autoretry_for=(Transient,), retry_backoff=1, retry_jitter=True,
          max_retries=5)
def flaky(self, key: str, failures: int) -> str:
    record(self, key)
    if self.request.retries < failures:
        raise Transient(f"attempt {self.request.retries} fails on purpose")
    return key


@app.task(bind=True, autoretry_for=(Transient,), max_retries=2, retry_kwargs={"countdown": 0})
def relapse(self, key: str) -> None:
    """Fails every time: two Celery retries at once, then the final failure."""
    record(self, key)
    raise Transient(f"try {self.request.retries} fails on purpose")


@app.task(bind=True)
def boom(self, key: str) -> None:
    """Always raises: a final failure."""
    record(self, key)
    raise ValueError(f"boom {key}")


# -- remote control (tests/e2e/test_remote_control.py) -------------------------------------------
# Imported here, not at the top: this section is appended for the remote-control tests.
import hashlib  # noqa: E402 - the section's own imports

from celery.worker.control import control_command  # noqa: E402


@control_command(args=[("payload", str)], signature="<payload>")
def payload_digest(state, payload: str) -> dict:
    """Reply with the size and SHA-256 of a broadcast's argument: proves that a worker received
    all of a large broadcast (pg_notify stops at 8000 bytes)."""
    return {"ok": {"size": len(payload), "sha256": hashlib.sha256(payload.encode()).hexdigest()}}


@control_command(args=[("seconds", float)], signature="<seconds>")
def slow_pong(state, seconds: float) -> dict:
    """Reply "pong" after ``seconds``: lets a test kill the client before the reply comes."""
    time.sleep(seconds)
    return {"ok": "pong"}
