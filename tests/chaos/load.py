"""Load for the chaos scenarios: a producer thread that keeps publishing through a fault, and the
tally every scenario prints (tasks sent, completed, duplicated, lost).

Every task is ``tests.chaos.app.sturdy_touch(key)`` with ``task_id = key``, so a job row, its
runs in ``public.runs`` and the key the producer sent all join on one value. A publish that fails is
retried by the producer with the same task id: the unique index on ``(queue, task_id, retries)``
makes that retry idempotent even when the failed attempt had in fact committed.

``python -m tests.chaos.load PREFIX COUNT RATE`` runs the same load in a process of its own (a
producer on a worker host, tests/chaos/hosts.py): one JSON line per ``apply_async`` call on
stdout, as it returns or raises (see :func:`main`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tests.chaos.app import sturdy_touch
from tests.support.processes import wait_for

__all__ = ["CHAOS_TASKS", "PUBLISH_RETRY", "TASK", "LoadProducer", "Tally", "tally",
           "wait_all_completed"]

#: Worker arguments that import tests.chaos.app's tasks into the tests.apps.e2e_app worker:
#: ``start_worker(broker_url, *CHAOS_TASKS, ...)``.
CHAOS_TASKS = ("--include", "tests.chaos.app")

#: The task of the load (its own write rides out a database restart: see tests/chaos/app.py).
TASK = sturdy_touch.name

#: Celery's publish retry policy for the load (its default gives up after ~0.4 s): a user who
#: wants publishes to ride out a database restart sets ``task_publish_retry_policy`` like this.
PUBLISH_RETRY = {"max_retries": 30, "interval_start": 0.1, "interval_step": 0.2,
                 "interval_max": 0.5}


@dataclass
class LoadProducer:
    """Publishes ``count`` sturdy_touch tasks at about ``rate`` per second from a thread.

    A publish that raises (after Celery's own retries) is counted in ``errors`` and sent again
    with the same task id until it goes through: nothing the producer meant to send is dropped.
    """

    prefix: str
    count: int
    rate: float = 100.0
    retry_policy: dict[str, Any] = field(default_factory=lambda: dict(PUBLISH_RETRY))
    errors: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, error)
    sent: list[str] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # monotonic time of each publish
    #: called after every ``apply_async`` call: (key, started, ended, error or None), the times
    #: as time.time()
    on_call: Callable[[str, float, float, str | None], None] | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def keys(self) -> list[str]:
        return [f"{self.prefix}-{i:05}" for i in range(self.count)]

    def start(self) -> LoadProducer:
        self._thread = threading.Thread(target=self._run, name=f"load-{self.prefix}",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        for n, key in enumerate(self.keys):
            due = started + n / self.rate
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return
            while not self._stop.is_set():
                began = time.time()
                try:
                    sturdy_touch.apply_async((key,), task_id=key, retry_policy=self.retry_policy)
                    self._called(key, began, None)
                    break
                except Exception as exc:  # noqa: BLE001 - counted, then sent again
                    self.errors.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))
                    self._called(key, began, self.errors[-1][1])
                    self._stop.wait(0.2)
            self.sent.append(key)
            self.sent_at.append(time.monotonic())

    def _called(self, key: str, began: float, error: str | None) -> None:
        if self.on_call is not None:
            self.on_call(key, began, time.time(), error)

    def join(self, timeout: float) -> None:
        """Wait for the last publish; raises if the producer is still going after ``timeout``."""
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the producer is stuck ({len(self.sent)} sent)"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


@dataclass(frozen=True)
class Tally:
    """What happened to the tasks a scenario sent."""

    sent: int
    completed: int     # job rows in state 'completed'
    duplicated: int    # tasks that started more than once
    lost: int          # tasks sent that never ran or whose job is not completed
    rows: int          # job rows of these tasks (more than ``sent`` would mean copies)
    states: dict[str, int]

    def line(self, scenario: str, extra: str = "") -> str:
        return (f"[figure] {scenario}: sent {self.sent}, completed {self.completed}, "
                f"duplicated {self.duplicated}, lost {self.lost}"
                + (f"; {extra}" if extra else ""))


def tally(pg: psycopg.Connection, keys: list[str], task: str = TASK,
          schema: str = "pgbroker") -> Tally:
    """Count, in SQL, the fate of the tasks whose ids (and touch keys) are ``keys``."""
    states = dict(pg.execute(
        f'SELECT state, count(*) FROM "{schema}".jobs WHERE task = %s AND task_id = ANY(%s)'
        " GROUP BY state", (task, keys)).fetchall())
    runs = dict(pg.execute("SELECT key, count(*) FROM public.runs WHERE key = ANY(%s)"
                           " GROUP BY key", (keys,)).fetchall())
    completed_ids = {r[0] for r in pg.execute(
        f'SELECT task_id FROM "{schema}".jobs WHERE task = %s AND task_id = ANY(%s)'
        " AND state = 'completed'", (task, keys))}
    lost = sum(1 for k in keys if k not in runs or k not in completed_ids)
    return Tally(sent=len(keys), completed=states.get("completed", 0),
                 duplicated=sum(1 for c in runs.values() if c > 1), lost=lost,
                 rows=sum(states.values()), states=states)


def wait_all_completed(pg: psycopg.Connection, keys: list[str], timeout: float,
                       schema: str = "pgbroker") -> Tally:
    """Wait until every job of ``keys`` is completed (each has run); return the tally."""
    def done() -> Tally | None:
        t = tally(pg, keys, schema=schema)
        return t if t.completed == len(keys) and t.lost == 0 else None

    def why() -> str:
        stuck = pg.execute(
            f'SELECT task_id, state, attempts, last_error FROM "{schema}".jobs'
            " WHERE task_id = ANY(%s) AND state <> 'completed' LIMIT 5", (keys,)).fetchall()
        return f"all {len(keys)} tasks completed ({tally(pg, keys, schema=schema)}; {stuck})"

    return wait_for(done, timeout, interval=0.25, message=why)


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.chaos.load PREFIX COUNT RATE [RETRY_POLICY]``: a :class:`LoadProducer`
    of the ``tests.apps.e2e_app`` app (its broker from ``PGBROKER_TEST_BROKER_URL``; Celery's
    publish retry policy as JSON, default :data:`PUBLISH_RETRY`) that writes each
    ``apply_async`` call as a JSON line, ``{"key", "start", "end", "error"}`` (times as
    time.time(), ``error`` null for a publish that returned), flushed at once: a test reads
    them as they come, and a publish that never returns shows as the line that never came."""
    prefix, count, rate, *policy = (argv if argv is not None else sys.argv[1:])
    lock = threading.Lock()

    def write(key: str, start: float, end: float, error: str | None) -> None:
        with lock:
            print(json.dumps({"key": key, "start": start, "end": end, "error": error}),
                  flush=True)

    retry = json.loads(policy[0]) if policy else dict(PUBLISH_RETRY)
    load = LoadProducer(prefix, int(count), rate=float(rate), retry_policy=retry,
                        on_call=write).start()
    load.join(24 * 3600)  # the test kills a producer that hangs


if __name__ == "__main__":
    main()
