"""What each admin page costs with 1,000,000 finished jobs in the table (``-m bench``).

    pytest -m bench tests/bench/test_admin_pages.py -s

Fills 1,000,000 finished jobs over the last 24 hours (the default retention; one in 80 dead), a
backlog of 10,000 pending, 1,000 scheduled and 40 running, then times every page through Flask's
test client (the same code as ``pgbroker serve``, without the HTTP server): the first load, which
rolls the day up into the per-minute statistics once, then the median of 5 loads of each page.
The figures are in docs/operations.md.
"""

from __future__ import annotations

import statistics
import time
import uuid

import psycopg
import pytest

from pgbroker._pg.store import Store
from pgbroker.admin import create_app
from pgbroker.admin.auth import Credentials
from pgbroker.settings import Settings
from tests.support.admin import fill_history
from tests.support.admin import csrf_of

pytestmark = pytest.mark.bench

QUEUES = ("celery", "mail", "reports", "billing")
TASKS = ("app.send_mail", "app.render_report", "app.charge", "app.resize_image",
         "app.sync_inventory", "app.expire")


def _backlog(pg: psycopg.Connection) -> str:
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues) VALUES"
               " (%s, 'bench-1', 1, %s)", (consumer, list(QUEUES)))
    pg.execute("""
        INSERT INTO pgbroker.jobs (id, queue, task, body, headers, state, run_at, locked_by,
                                   attempts)
        SELECT gen_random_uuid(), 'celery', 'app.send_mail', '[[], {}, {}]', '{}', s.state,
               now() + CASE WHEN s.state = 'scheduled' THEN interval '1 hour'
                            ELSE - interval '1 min' END,
               CASE WHEN s.state = 'running' THEN %s::uuid END,
               (s.state = 'running')::int
        FROM (SELECT 'pending' AS state, generate_series(1, 10000)
              UNION ALL SELECT 'scheduled', generate_series(1, 1000)
              UNION ALL SELECT 'running', generate_series(1, 40)) AS s
    """, (consumer,))
    pg.execute("INSERT INTO pgbroker.queues (name) SELECT unnest(%s::text[])", (list(QUEUES),))
    return str(pg.execute("SELECT id FROM pgbroker.jobs WHERE state = 'dead' LIMIT 1"
                          ).fetchone()[0])


def test_bench_admin_pages_at_1m_finished_rows(db_url: str, pg: psycopg.Connection) -> None:
    began = time.perf_counter()
    fill_history(pg, 1_000_000, 86400, queues=QUEUES, tasks=TASKS)
    dead = _backlog(pg)
    pg.execute("VACUUM ANALYZE pgbroker.jobs")
    size = pg.execute("SELECT pg_size_pretty(pg_total_relation_size('pgbroker.jobs'))"
                      ).fetchone()[0]
    print(f"\nloaded 1,000,000 finished + 11,040 active jobs ({size}) in "
          f"{time.perf_counter() - began:.0f} s")

    creds = Credentials(token="bench-token-0123456789")
    app = create_app(db_url, credentials=creds)
    client = app.test_client()
    token = csrf_of(client.get("/login").text)
    client.post("/login", data={"token": creds.token, "csrf_token": token})
    try:
        t0 = time.perf_counter()
        assert client.get("/").status_code == 200
        first = time.perf_counter() - t0
        rolled = pg.execute("SELECT count(*), sum(succeeded + failed) FROM pgbroker.stats_finished"
                            ).fetchone()
        print(f"first overview (rolls up the day: {rolled[0]} rows for {rolled[1]} jobs): "
              f"{first * 1000:.0f} ms")
        assert rolled[1] >= 990_000

        pages = ["/", "/overview/live", "/charts?range=1h", "/charts?range=24h",
                 "/charts?range=7d", "/queues/mail", "/queues/mail?task=app.charge&range=24h",
                 "/workers", "/jobs", "/jobs?state=dead", "/jobs?state=pending&queue=celery",
                 "/jobs?state=completed&queue=billing&task=app.expire",
                 "/jobs?text=order%20123456", "/jobs?state=dead&text=order%2012",
                 f"/jobs/{dead}", "/jobs/bulk?action=retry&state=dead&queue=mail",
                 "/jobs/bulk?action=cancel", "/dead", "/beat", "/audit"]
        rows: list[tuple[str, float, float]] = []
        for path in pages:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                response = client.get(path)
                times.append((time.perf_counter() - t0) * 1000)
                assert response.status_code == 200, path
            rows.append((path, statistics.median(times), max(times)))
        print("| page | median | slowest of 5 |\n|---|---|---|")
        for path, median, slowest in rows:
            print(f"| `{path}` | {median:.0f} ms | {slowest:.0f} ms |")

        # the sweeper's share: one busy minute (1,000,000 a day is ~700 a minute) rolled up
        store = Store(db_url, Settings())
        try:
            pg.execute("UPDATE pgbroker.stats_rollup SET finished_upto = finished_upto"
                       " - interval '1 minute', depth_minute = NULL")
            pg.execute("DELETE FROM pgbroker.stats_finished WHERE minute >= (SELECT"
                       " finished_upto FROM pgbroker.stats_rollup)")
            t0 = time.perf_counter()
            written = store.rollup()
            print(f"sweeper's rollup of one minute and a backlog sample: "
                  f"{(time.perf_counter() - t0) * 1000:.0f} ms ({written} rows)")
            t0 = time.perf_counter()
            assert store.rollup() == 0
            print(f"a sweep's rollup with nothing due: {(time.perf_counter() - t0) * 1000:.1f} ms")
        finally:
            store.close()
    finally:
        app.extensions["pgbroker"].close()
