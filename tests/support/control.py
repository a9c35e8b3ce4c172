"""Helpers for the remote-control, events and Flower tests: the ``celery`` command line as a
subprocess against the test's broker, node names of the test workers, and the rows that reply and
event queues leave in the database.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from celery.utils.nodenames import gethostname

from tests.support import processes as helpers
from tests.support.workers import start_worker
from tests.support.producers import drop_pools
from tests.support.processes import REPO_ROOT, CeleryProcess, WorkerProcess, wait_for

__all__ = ["REPLY_QUEUES", "REPLY_TIMEOUT", "all_replies", "celery_cli", "cli_json",
           "client_app", "leftovers", "node", "start_celery", "start_workers", "timed_ping"]

#: Seconds every ``celery inspect|control`` call waits for replies. Celery's default (1 s) is
#: short for a machine shared with other test runs; calls without ``-d`` always wait this long.
REPLY_TIMEOUT = 2.0

#: LIKE pattern of the reply queues of ``celery inspect|control`` clients (one per call).
REPLY_QUEUES = "%.reply.celery.pidbox"


def node(worker: WorkerProcess) -> str:
    """The Celery node name of a worker started by ``tests.support.processes.run_worker``
    (``-n name@%h``)."""
    return f"{worker.name}@{gethostname()}"


def start_workers(broker_url: str, *argsets: tuple[str, ...]) -> list[WorkerProcess]:
    """Start one ``tests.apps.e2e_app`` worker per tuple of arguments, all at once; wait until
    each is ready (its remote-control mailbox is then consumed)."""
    workers = [start_worker(broker_url, *args, ready=False) for args in argsets]
    for worker in workers:
        worker.wait_ready(90)
    return workers


def start_celery(broker_url: str, name: str, *args: str, log_dir: Path,
                 env: dict[str, str] | None = None) -> CeleryProcess:
    """``python -m celery -A tests.apps.e2e_app ARGS`` in the background (stopped by the autouse
    fixture of tests/conftest.py at the end of the test)."""
    argv = [sys.executable, "-m", "celery", "-A", "tests.apps.e2e_app", *args]
    log_dir.mkdir(parents=True, exist_ok=True)
    return CeleryProcess(argv, helpers._env(broker_url, env), log_dir / f"{name}.log", name)


def celery_cli(broker_url: str, *args: str, env: dict[str, str] | None = None,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -m celery -A tests.apps.e2e_app ARGS`` against ``broker_url``; return it
    finished.

    Raises:
        AssertionError: ``check`` and it exited non-zero (with its output).
    """
    argv = [sys.executable, "-m", "celery", "-A", "tests.apps.e2e_app", *args]
    done = subprocess.run(argv, check=False, cwd=REPO_ROOT, env=helpers._env(broker_url, env),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n"
                             f"{done.stderr}")
    return done


def cli_json(broker_url: str, *args: str) -> dict[str, Any]:
    """``celery inspect|control ARGS --json -t REPLY_TIMEOUT``: the replies by node name."""
    done = celery_cli(broker_url, *args, "--json", "-t", str(REPLY_TIMEOUT))
    replies = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(replies, list):  # `control` prints a list of {node: reply}, `inspect` a dict
        return {name: reply for one in replies for name, reply in one.items()}
    return replies


@contextmanager
def client_app(broker_url: str, **conf: Any) -> Iterator[Celery]:
    """A Celery app of its own (not ``tests.apps.e2e_app``) for remote control from the test
    process, with ``conf`` applied; its connections are closed on exit, as when ``celery
    inspect`` exits."""
    app = Celery("rc-client", broker=broker_url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, **conf)
    try:
        yield app
    finally:
        drop_pools(app)  # kombu's global producer pools too: their leases must end now
        app.close()


def timed_ping(app: Celery,
               timeout: float = REPLY_TIMEOUT) -> tuple[dict[str, Any], dict[str, float]]:
    """``app.control.inspect().ping()``; returns the replies and, per node, the seconds from the
    call to its reply (the call itself always lasts ``timeout``)."""
    start = time.monotonic()
    arrived: dict[str, float] = {}

    def callback(reply: dict[str, Any]) -> None:
        for name in reply:
            arrived[name] = time.monotonic() - start

    replies = app.control.inspect(timeout=timeout, callback=callback).ping() or {}
    return replies, arrived


def all_replies(call: Callable[[], dict[str, Any] | None], nodes: Iterable[str],
                timeout: float = 60) -> dict[str, Any]:
    """``call()`` (an ``app.control.inspect(...)`` method) until every node of ``nodes`` is among
    its replies; return them.

    A retry is needed after a call that returned early (``destination``/``limit``): a worker
    then drops its reply to a call made within a second (core bug, see
    ``test_inspect_right_after_an_early_return_is_answered``)."""
    wanted = set(nodes)
    return wait_for(lambda: (r := call() or {}) and wanted <= set(r) and r, timeout,
                    interval=0.1, message=f"replies from {sorted(wanted)}")


def leftovers(pg: psycopg.Connection) -> dict[str, Any]:
    """What reply queues left in every table (and every broadcast)."""
    like = REPLY_QUEUES
    return {
        "queues": pg.execute("SELECT count(*) FROM pgbroker.queues WHERE name LIKE %s",
                             (like,)).fetchone()[0],
        "bindings": pg.execute("SELECT count(*) FROM pgbroker.bindings WHERE queue LIKE %s",
                               (like,)).fetchone()[0],
        "jobs": pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE queue LIKE %s",
                           (like,)).fetchone()[0],
        "broadcasts": pg.execute("SELECT count(*) FROM pgbroker.broadcasts").fetchone()[0],
    }
