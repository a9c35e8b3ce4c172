"""The Celery app of the job-keys tests (dedupe, concurrency keys, rate limits: issue 22), run in
real ``celery worker`` processes.

Every run records its start and end in ``public.key_runs`` (database clock), with the job's
concurrency key as the worker received it, so a test reads overlaps and rates with SQL.
"""

from __future__ import annotations

import os
import signal
import time

from celery import Celery

from tests.apps import e2e_app as e2e

app = Celery("keysapp", broker=e2e.BROKER_URL)
# e2e's configuration: task_acks_late above all -- a job is 'running' until its ack, and
# concurrency keys and dedupe_active count running jobs
app.conf.update(e2e.app.conf.changes)

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS public.key_runs (
    n serial PRIMARY KEY,
    task text NOT NULL,
    arg text NOT NULL,
    ckey text,
    pid integer NOT NULL,
    retries integer NOT NULL,
    started timestamptz NOT NULL,
    ended timestamptz
)
"""

_db = e2e._db  # one connection per process, shared with the e2e app's tasks


def _start(task, arg: str) -> int:
    headers = task.request.headers or {}
    ckey = headers.get("concurrency_key", getattr(task.request, "concurrency_key", None))
    return _db().execute(
        "INSERT INTO public.key_runs (task, arg, ckey, pid, retries, started)"
        " VALUES (%s, %s, %s, %s, %s, clock_timestamp()) RETURNING n",
        (task.name.rsplit(".", 1)[-1], arg, ckey, os.getpid(), task.request.retries or 0),
    ).fetchone()[0]


def _end(n: int) -> None:
    _db().execute("UPDATE public.key_runs SET ended = clock_timestamp() WHERE n = %s", (n,))


@app.task(bind=True, name="keys.sync")
def sync(self, arg: str, seconds: float = 0.0) -> str:
    n = _start(self, arg)
    time.sleep(seconds)  # the task's body: a task that runs this long
    _end(n)
    return arg


@app.task(bind=True, name="keys.early", acks_late=False)
def early(self, arg: str, seconds: float = 0.0) -> str:
    """Acked on receipt, against the advice: a concurrency key is freed before it runs."""
    n = _start(self, arg)
    time.sleep(seconds)  # the task's body: a task that runs this long
    _end(n)
    return arg


@app.task(bind=True, name="keys.plain")
def plain(self, arg: str) -> str:
    _end(_start(self, arg))
    return arg


@app.task(bind=True, name="keys.flaky", max_retries=3)
def flaky(self, arg: str, failures: int, seconds: float = 0.0) -> str:
    n = _start(self, arg)
    time.sleep(seconds)  # the task's body: a task that runs this long
    _end(n)
    if self.request.retries < failures:
        raise self.retry(countdown=1)
    return arg


@app.task(bind=True, name="keys.die_once")
def die_once(self, arg: str) -> str:
    """Kills its pool process on its first delivery (SIGKILL), runs on the next."""
    n = _start(self, arg)
    first = _db().execute("SELECT count(*) FROM public.key_runs WHERE arg = %s",
                          (arg,)).fetchone()[0] == 1
    if first:
        os.kill(os.getpid(), signal.SIGKILL)
    _end(n)
    return arg
