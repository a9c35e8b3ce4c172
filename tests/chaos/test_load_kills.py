"""Load + SIGKILL: 5,000 tasks while a worker's main process is SIGKILLed every few seconds and
started again.

Two workers with ``tests.chaos.app``'s tasks (``-c 4``, prefetch 1, acks late) consume while a
producer publishes 100 tasks/s; every 2-4 s one of them (in turn) loses its main process to
SIGKILL -- its pool children are orphaned and killed a moment later, as a supervisor would -- and
a new one is started. Every task must complete; a task may run twice only if it was in the killed
worker's hands (running, or finished with its ack not yet written). Counts are printed (``pytest
-s``); it takes a minute or more, hence ``slow``: ``pytest -m slow tests/chaos/test_load_kills.py``.
"""

from __future__ import annotations

import random
import signal
import time

import psycopg
import pytest

from tests.chaos.load import CHAOS_TASKS, LoadProducer, wait_all_completed
from tests.support.workers import start_worker
from tests.support.processes import WorkerProcess

TASKS = 5000
CONCURRENCY = 4
RATE = 100  # tasks/s: about 50 s of load, so a dozen or more kills land in it
OPTIONS = {"sweep_interval": 1}  # the advisory lock of a dead worker is checked every second


def _completed(pg: psycopg.Connection) -> int:
    return pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE state = 'completed'"
                      ).fetchone()[0]


@pytest.mark.slow
def test_load_with_a_worker_sigkilled_every_few_seconds(
        producer: object, runs: psycopg.Connection, broker_url: str) -> None:
    workers: list[WorkerProcess] = [
        start_worker(broker_url, *CHAOS_TASKS, "-c", str(CONCURRENCY), options=OPTIONS)
        for _ in range(2)]
    load = LoadProducer("kill", TASKS, rate=RATE).start()
    killed_pids: set[int] = set()
    kills = 0
    started = time.monotonic()
    rng = random.Random(8)
    while (len(load.sent) < TASKS or _completed(runs) < 0.95 * TASKS) \
            and time.monotonic() - started < 600:
        time.sleep(rng.uniform(2, 4))  # the scenario: a kill every 2-4 s
        victim = workers[kills % 2]
        killed_pids |= {victim.pid, *victim.child_pids()}
        victim.kill(signal.SIGKILL)  # the main process only
        victim.wait(10)
        time.sleep(0.5)  # the scenario: the pool children outlive their parent a while
        victim.kill_group(signal.SIGKILL)  # then its orphaned pool children, as systemd would
        workers[kills % 2] = start_worker(broker_url, *CHAOS_TASKS, "-c", str(CONCURRENCY),
                                                options=OPTIONS, ready=False)
        kills += 1
    load.join(120)
    result = wait_all_completed(runs, load.keys, 300)
    elapsed = time.monotonic() - started

    assert result.rows == result.sent and result.lost == 0
    twice = runs.execute(
        "SELECT key, array_agg(pid ORDER BY n) FROM public.runs WHERE key = ANY(%s)"
        " GROUP BY key HAVING count(*) > 1", (load.keys,)).fetchall()
    for key, pids in twice:  # only a task a killed worker held ran again
        assert pids[0] in killed_pids, (key, pids)
    # per kill at most the prefetch window (running) plus as many finished, ack not yet written
    assert len(twice) <= kills * 2 * CONCURRENCY, (len(twice), kills)
    print("\n" + result.line(
        f"load + SIGKILL ({TASKS} tasks, 2 workers -c {CONCURRENCY})",
        f"{kills} SIGKILLs in {elapsed:.0f}s, {len(load.errors)} publish errors; "
        f"{TASKS / elapsed:.0f} tasks/s overall"))
