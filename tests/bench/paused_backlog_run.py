"""One run of the paused-backlog bench (tests/bench/test_paused_backlog_bench.py), with the
pgbroker of the working directory's tree: ``python paused_backlog_run.py URL N M BATCH`` migrates
the (fresh) database at URL, queues N jobs of a task name at the head of queue ``q`` (older than
the rest), pauses that name as an operator does (``Operations.pause_task``), queues M jobs of
another task name behind them, and claims those M through ``Store.claim`` in claims of BATCH, each
carrying the acks of the previous one (as the worker's event loop does). Prints the median
milliseconds per claim, then the claimed jobs per second. None of the paused name's jobs may be
claimed."""

from __future__ import annotations

import statistics
import sys
import time
import uuid

from pgbroker._pg.store import Store
from pgbroker.migrate import migrate
from pgbroker.ops import Operations
from pgbroker.settings import Settings


def _queue(store: Store, task: str, n: int, minutes_ago: int) -> None:
    store.conn.execute("""
        INSERT INTO pgbroker.jobs (id, queue, task, body, state, run_at)
        SELECT gen_random_uuid(), 'q', %s, '\\x00', 'pending',
               now() - make_interval(mins => %s) + make_interval(secs => i / 1000.0)
        FROM generate_series(1, %s) AS i""", (task, minutes_ago, n))


def main() -> None:
    url, n, m, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    migrate(url)
    store = Store(url, Settings())
    _queue(store, "bench.paused", n, 600)          # the head of the queue
    Operations(store.conn, actor="bench", via="bench").pause_task("bench.paused", "bench")
    _queue(store, "bench.other", m, 60)            # behind it
    store.conn.execute("VACUUM ANALYZE pgbroker.jobs")
    consumer = uuid.uuid4()
    acks: list[tuple[uuid.UUID, int]] = []
    claimed, times = 0, []
    start = time.perf_counter()
    while True:
        began = time.perf_counter()
        rows = store.claim("q", batch, consumer, acks)
        times.append(time.perf_counter() - began)
        if not rows:
            break
        assert {r.task for r in rows} == {"bench.other"}, {r.task for r in rows}
        claimed += len(rows)
        acks = [(r.id, r.attempt) for r in rows]
    store.ack(acks)
    seconds = time.perf_counter() - start
    assert claimed == m, claimed
    print(statistics.median(times) * 1000, m / seconds)


if __name__ == "__main__":
    main()
