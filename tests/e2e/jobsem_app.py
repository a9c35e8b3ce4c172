"""The Celery app of the issue-22 job-semantics tests: tasks that complete their own delivery
(pgbroker.complete), kill their pool process, or fail; and receivers of pgbroker's signals that
write what they received to ``public.signals``, so a test reads it with SQL.

Tables (``DDL``): ``public.exact_rows`` (one row per committed run of ``write_once``; a deferred
trigger makes a commit slow when asked, so a test can kill the worker *during* COMMIT),
``public.phases`` (where a run stopped, written outside the task's transaction), and
``public.signals``.
"""

from __future__ import annotations

import os
import signal
import time

import psycopg
from celery import Celery
from celery.exceptions import Reject
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import pgbroker
from pgbroker._celery.complete import current_delivery
from pgbroker._pg.local_server import normalize_url
from tests.apps.e2e_app import RUNS_DDL, WORKER_CONF
from tests.apps.e2e_app import _db  # an autocommit connection of this process, outside any task's

BROKER_URL = os.environ.get("PGBROKER_TEST_BROKER_URL", "pgbroker://postgres@127.0.0.1/postgres")
DB_URL = normalize_url(BROKER_URL)

app = Celery("jobsemapp", broker=BROKER_URL)
app.conf.update(
    WORKER_CONF,
    # a soft shutdown (issue 27, item 3): the tasks get this long before a cold shutdown
    worker_soft_shutdown_timeout=float(os.environ.get("PGBROKER_TEST_SOFT_SHUTDOWN", "0")),
    # the receivers of pgbroker's signals live in a module of their own, imported as a worker
    # (or `pgbroker -A ... sweep`) imports an app's include list
    include=["tests.e2e.jobsem_receivers"],
)

DDL = """
CREATE TABLE IF NOT EXISTS public.exact_rows (
    n serial PRIMARY KEY, key text NOT NULL, attempt integer NOT NULL, slow boolean NOT NULL
);
CREATE OR REPLACE FUNCTION public.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.slow THEN PERFORM pg_sleep(4); END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS exact_rows_slow ON public.exact_rows;
CREATE CONSTRAINT TRIGGER exact_rows_slow AFTER INSERT ON public.exact_rows
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.slow_commit();
CREATE TABLE IF NOT EXISTS public.phases (
    n serial PRIMARY KEY, key text NOT NULL, attempt integer NOT NULL, phase text NOT NULL,
    pid integer NOT NULL
);
CREATE TABLE IF NOT EXISTS public.signals (
    n serial PRIMARY KEY, kind text NOT NULL, task text, job_id uuid, reason text,
    attempts integer, job_ids uuid[], actor text, pid integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
""" + RUNS_DDL


def _phase(key: str, attempt: int, phase: str) -> None:
    _db().execute("INSERT INTO public.phases (key, attempt, phase, pid) VALUES (%s, %s, %s, %s)",
                  (key, attempt, phase, os.getpid()))


def _run(name: str, key: str) -> None:
    _db().execute("INSERT INTO public.runs (task, key, pid) VALUES (%s, %s, %s)",
                  (name, key, os.getpid()))


# -- pgbroker.complete ---------------------------------------------------------------------------

def _write(db, key: str, attempt: int, stop: str | None) -> None:
    """The task's work inside its transaction; on its first attempt, wait where ``stop`` says
    so that the test can kill the worker there."""
    first = attempt == 1
    slow = first and stop == "during"
    if isinstance(db, psycopg.Connection):
        db.execute("INSERT INTO public.exact_rows (key, attempt, slow) VALUES (%s, %s, %s)",
                   (key, attempt, slow))
    else:
        db.execute(text("INSERT INTO public.exact_rows (key, attempt, slow) "
                        "VALUES (:key, :attempt, :slow)"),
                   {"key": key, "attempt": attempt, "slow": slow})
    pgbroker.complete(db)
    _phase(key, attempt, "completed-in-tx")
    if first and stop == "before":
        time.sleep(30)  # killed here: before the commit


@app.task(bind=True)
def write_once(self, key: str, stop: str | None = None, driver: str = "psycopg") -> str:
    _, attempt = current_delivery(self)
    _phase(key, attempt, "started")
    if driver == "psycopg":
        with psycopg.connect(DB_URL) as conn:   # not autocommit: one transaction
            _write(conn, key, attempt, stop)
            if attempt == 1 and stop == "during":
                _phase(key, attempt, "committing")
            conn.commit()
    else:
        engine = _engine()
        with Session(engine) as session, session.begin():
            _write(session, key, attempt, stop)
            if attempt == 1 and stop == "during":
                _phase(key, attempt, "committing")
    _phase(key, attempt, "committed")
    if attempt == 1 and stop == "after":
        time.sleep(30)  # killed here: after the commit, before the worker's ack
    return key


_engines: dict[int, object] = {}


def _engine():
    if os.getpid() not in _engines:
        _engines[os.getpid()] = create_engine(DB_URL.replace("postgresql://",
                                                             "postgresql+psycopg://", 1))
    return _engines[os.getpid()]


@app.task(bind=True)
def complete_then_fail(self, key: str) -> None:
    """Completes its delivery, commits, then raises: what it committed stands."""
    with psycopg.connect(DB_URL) as conn:
        conn.execute("INSERT INTO public.exact_rows (key, attempt, slow) VALUES (%s, 1, false)",
                     (key,))
        pgbroker.complete(conn)
    raise ValueError("after the commit")


@app.task(bind=True)
def complete_autocommit(self, key: str) -> None:
    with psycopg.connect(DB_URL, autocommit=True) as conn:
        pgbroker.complete(conn)


# -- poison tasks, failures ----------------------------------------------------------------------

@app.task(bind=True)
def crash(self, key: str) -> None:
    """Kills the pool process running it, every time -- unless its key says "survive"."""
    _run("crash", key)
    if not key.startswith("survive"):
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(bind=True, reject_on_worker_lost=False)
def crash_acked(self, key: str) -> None:
    """Kills its pool process; Celery then fails it (WorkerLostError) rather than requeue it."""
    _run("crash_acked", key)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(bind=True)
def reject_again(self, key: str) -> None:
    """Gives its message back every time (Reject(requeue=True)): its pool process lives on."""
    _run("reject_again", key)
    raise Reject(requeue=True)


@app.task(bind=True)
def hang(self, key: str) -> None:
    """Runs until its worker is killed."""
    _run("hang", key)
    time.sleep(120)  # the task's body: longer than any test waits


_hoard: list[bytearray] = []


@app.task(bind=True)
def hog(self, key: str, megabytes: int) -> int:
    """Heavy work: keeps ``megabytes`` of memory in its pool process; returns its pid."""
    _run("hog", key)
    _hoard.append(bytearray(megabytes * 1024 * 1024))
    for i in range(0, len(_hoard[-1]), 4096):  # touch every page: resident, not just reserved
        _hoard[-1][i] = 1
    return os.getpid()


@app.task(bind=True)
def ok(self, key: str) -> str:
    _run("ok", key)
    return key


@app.task(bind=True)
def boom(self, key: str) -> None:
    _run("boom", key)
    raise ValueError(f"boom {key}")
