"""Test helpers for applications: what a test enqueued, and running it in the test's process.

In the spirit of River's ``rivertest`` and ``Oban.Testing``::

    from pgbroker import testing

    def test_confirm_sends_the_email(db):               # db: the connection the code wrote on
        confirm(reservation)                            # enqueues send_confirmation (ref,)
        testing.assert_enqueued(db, send_confirmation, args=["R-1"])
        [ran] = testing.run_enqueued(db)                # runs it here, marks it completed
        assert ran.result.get() == "sent"

``db`` is the connection the code under test writes on (a psycopg 3 ``Connection``, a SQLAlchemy
``Session``/``Connection``, a Django connection: ``django.db.connection``), so the helpers see
the jobs of a transaction that is still open: Django's ``TestCase`` never commits. ``None``: a
connection of their own to the app's broker (committed jobs only).

Matching: ``task`` is a task object or a name; ``args`` must equal the job's arguments, and
``kwargs`` must be contained in the job's (only the keys given are compared). Bodies are decoded
with the app's ``accept_content`` (JSON by default). :func:`run_enqueued` runs each due job with
``Task.apply`` (Celery's eager path: retries run at once, in the same call) and marks it
``completed``, or ``dead`` with its error; it runs the jobs those jobs enqueue as well, up to
``limit``. Nothing here is for production: a job run here was never claimed, so no lease, no
rate limit, no concurrency key holds it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import psycopg
from celery import current_app
from kombu.serialization import loads, prepare_accept_content

from ._celery.app import broker_of
from ._pg import driver as _db
from ._pg.catalogue import Queries
from ._produce.connectors import connector_for

__all__ = ["EnqueuedJob", "Ran", "assert_enqueued", "clear_enqueued", "enqueued",
           "refute_enqueued", "run_enqueued"]

#: The states of a job still waiting to run.
WAITING = ("pending", "scheduled")


@dataclasses.dataclass(frozen=True)
class EnqueuedJob:
    """One job as a test sees it: its row, with the task's arguments decoded."""

    id: uuid.UUID
    task: str | None
    task_id: str | None
    queue: str
    state: str
    args: list[Any] | None
    kwargs: dict[str, Any] | None
    headers: dict[str, Any]
    priority: int
    attempts: int
    run_at: datetime
    idempotency_key: str | None
    last_error: str | None


@dataclasses.dataclass(frozen=True)
class Ran:
    """A job :func:`run_enqueued` ran, and Celery's ``EagerResult`` of it."""

    job: EnqueuedJob
    result: Any


def _app(app: Any) -> Any:
    return app if app is not None else current_app._get_current_object()


def _name(task: Any) -> str | None:
    return task if task is None or isinstance(task, str) else task.name


@contextlib.contextmanager
def _connection(db: Any, app: Any) -> Iterator[psycopg.Connection[Any]]:
    if db is not None:
        yield connector_for(db).connection()
        return
    conn = _db.connect(broker_of(app).conninfo, application_name="pgbroker testing")
    try:
        yield conn
    finally:
        _db.close(conn)


def _decoded(row: dict[str, Any], accept: Any) -> tuple[Any, Any]:
    try:
        body = loads(bytes(row["body"]), row["content_type"], row["content_encoding"],
                     accept=accept)
    except Exception:  # noqa: BLE001 - a plain kombu message, another serializer
        return None, None
    if isinstance(body, list) and len(body) == 3:  # Celery protocol 2: (args, kwargs, embed)
        return list(body[0]), dict(body[1])
    if isinstance(body, dict):  # protocol 1
        return list(body.get("args") or ()), dict(body.get("kwargs") or {})
    return None, None


def _jobs(conn: psycopg.Connection[Any], app: Any, *, task: Any, queue: str | None,
          states: Sequence[str] | None, due: bool) -> list[EnqueuedJob]:
    rows = Queries(broker_of(app).settings.schema).dicts(conn, "job_list_for_test", {
        "states": list(states) if states is not None else None, "task": _name(task),
        "queue": queue, "due": due})
    accept = prepare_accept_content(app.conf.accept_content)
    found = []
    for row in rows:
        args, kwargs = _decoded(row, accept)
        headers = row["headers"]  # jsonb: text on Django's connection (Django parses its own)
        found.append(EnqueuedJob(
            id=row["id"], task=row["task"], task_id=row["task_id"], queue=row["queue"],
            state=row["state"], args=args, kwargs=kwargs,
            headers=json.loads(headers) if isinstance(headers, str) else headers,
            priority=row["priority"], attempts=row["attempts"], run_at=row["run_at"],
            idempotency_key=row["idempotency_key"], last_error=row["last_error"]))
    return found


def enqueued(db: Any = None, task: Any = None, *, queue: str | None = None,
             states: Sequence[str] | None = WAITING, app: Any = None) -> list[EnqueuedJob]:
    """The jobs waiting to run (or of ``states``; None: every state), oldest first."""
    app = _app(app)
    with _connection(db, app) as conn:
        return _jobs(conn, app, task=task, queue=queue, states=states, due=False)


def _matches(job: EnqueuedJob, args: Sequence[Any] | None,
             kwargs: dict[str, Any] | None) -> bool:
    if args is not None and job.args != list(args):
        return False
    return kwargs is None or (job.kwargs is not None and all(
        key in job.kwargs and job.kwargs[key] == value for key, value in kwargs.items()))


def _describe(jobs: list[EnqueuedJob]) -> str:
    return "\n".join(f"  {j.task} args={j.args!r} kwargs={j.kwargs!r} queue={j.queue} "
                     f"state={j.state}" for j in jobs) or "  (none)"


def assert_enqueued(db: Any = None, task: Any = None, *, args: Sequence[Any] | None = None,
                    kwargs: dict[str, Any] | None = None, queue: str | None = None,
                    count: int | None = None, states: Sequence[str] | None = WAITING,
                    app: Any = None) -> list[EnqueuedJob]:
    """Assert that jobs matching (see the module docstring) are enqueued: at least one, or
    exactly ``count``; return them.

    Raises:
        AssertionError: listing the jobs that are there.
    """
    found = enqueued(db, task, queue=queue, states=states, app=app)
    matching = [job for job in found if _matches(job, args, kwargs)]
    if (not matching) if count is None else len(matching) != count:
        wanted = "a job" if count is None else f"{count} job(s)"
        raise AssertionError(
            f"expected {wanted} of task {_name(task)!r} with args={args!r} kwargs={kwargs!r}"
            f"{f' in queue {queue!r}' if queue else ''}, found {len(matching)}; enqueued:\n"
            + _describe(enqueued(db, None, queue=None, states=states, app=app)))
    return matching


def refute_enqueued(db: Any = None, task: Any = None, *, args: Sequence[Any] | None = None,
                    kwargs: dict[str, Any] | None = None, queue: str | None = None,
                    states: Sequence[str] | None = WAITING, app: Any = None) -> None:
    """Assert that no job matching is enqueued (``task`` None: no job at all)."""
    found = [job for job in enqueued(db, task, queue=queue, states=states, app=app)
             if _matches(job, args, kwargs)]
    if found:
        raise AssertionError(f"expected no job of task {_name(task)!r} with args={args!r} "
                             f"kwargs={kwargs!r}, found {len(found)}:\n" + _describe(found))


def clear_enqueued(db: Any = None, *, app: Any = None) -> int:
    """Delete every job (of every state); return how many. For tests that commit, such as
    Django's ``TransactionTestCase``, whose flush empties the tables of models only."""
    app = _app(app)
    with _connection(db, app) as conn:
        return Queries(broker_of(app).settings.schema).rowcount(conn, "job_delete_for_test")


def run_enqueued(db: Any = None, task: Any = None, *, queue: str | None = None,
                 limit: int = 1000, propagate: bool = True, app: Any = None) -> list[Ran]:
    """Run the jobs due now in this process, in the order a worker would take them, with the
    ones they enqueue; mark each ``completed`` (or ``dead``); return what ran.

    Raises:
        the first task's exception when ``propagate`` (after marking its job ``dead``);
        AssertionError: more than ``limit`` jobs ran (a task that enqueues itself).
    """
    app = _app(app)
    queries = Queries(broker_of(app).settings.schema)
    ran: list[Ran] = []
    with _connection(db, app) as conn:
        while True:
            due = _jobs(conn, app, task=task, queue=queue, states=WAITING, due=True)
            if not due:
                return ran
            for job in due:
                if len(ran) >= limit:
                    raise AssertionError(f"run_enqueued ran {limit} jobs and more are due")
                result = _run(app, job)
                error = None if result.successful() else repr(result.result)
                queries.execute(conn, "job_finish_for_test", {"id": job.id, "error": error})
                ran.append(Ran(job, result))
                if error is not None and propagate:
                    raise result.result


def _run(app: Any, job: EnqueuedJob) -> Any:
    if job.task is None or job.args is None:
        raise AssertionError(f"job {job.id} is not a Celery task message this process can run")
    task = app.tasks.get(job.task)
    if task is None:
        raise AssertionError(f"job {job.id}: task {job.task!r} is not registered in this "
                             "process (import its module)")
    headers = {k: v for k, v in job.headers.items() if k not in ("id", "task", "retries")}
    return task.apply(job.args, job.kwargs or {}, task_id=job.task_id, headers=headers,
                      throw=False)
