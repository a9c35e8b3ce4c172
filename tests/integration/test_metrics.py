"""Metrics against a real database with jobs in every state: every number exact.

Rows are fabricated with SQL (the states the transport would leave), then read through
:class:`pgbroker.metrics.MetricsReader` and through the Prometheus exposition.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pgbroker.metrics import MetricsReader, Snapshot, prometheus_registry
from pgbroker.ops import is_poison
from tests.support.db import CHILD_KILLED, CHILD_LOST, LOST, add_job, add_jobs

@pytest.fixture
def populated(pg: psycopg.Connection) -> psycopg.Connection:
    """Two queues, two tasks, every state, with known numbers."""
    pg.execute("INSERT INTO pgbroker.queues (name, paused) VALUES ('q1', false), ('q2', true),"
               " ('idle', false)")
    # q1 / t.a
    add_jobs(pg, 3, "pending")
    add_job(pg, "pending", attempts=1)                     # requeued once: a redelivery waits
    add_job(pg, "pending", run_at=_ago(pg, 120))           # the oldest due job: 120 s
    add_jobs(pg, 2, "scheduled", run_at=_ago(pg, -3600))
    add_jobs(pg, 2, "running")
    add_job(pg, "running", attempts=2)                     # a redelivery running
    add_jobs(pg, 4, "completed")
    add_job(pg, "completed", updated_at=_ago(pg, 2 * 86400))  # outside the window
    add_job(pg, "cancelled")
    add_jobs(pg, 2, "expired")
    add_job(pg, "dead", last_error="ValueError: boom")
    add_job(pg, "dead", last_error=LOST, attempts=3, max_attempts=3)
    # q1 / t.b
    add_job(pg, "pending", task="t.b", run_at=_ago(pg, 30))
    add_job(pg, "dead", task="t.b", last_error=CHILD_KILLED, attempts=3, max_attempts=3)
    # q2 (paused), plain kombu messages (no task name)
    add_jobs(pg, 5, "pending", queue="q2", task=None)
    add_job(pg, "completed", queue="q2", task=None)
    # consumers: two alive on q1 (one also on q2), one whose heartbeat is long gone
    for queues, age in ((["q1"], 0), (["q1", "q2"], 1), (["q1"], 3600)):
        pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues, heartbeat_at)"
                   " VALUES (%s, 'h', 1, %s, now() - make_interval(secs => %s))",
                   (uuid.uuid4(), queues, age))
    return pg


def _ago(pg: psycopg.Connection, seconds: float) -> Any:
    return pg.execute("SELECT now() - make_interval(secs => %s)", (seconds,)).fetchone()[0]


def _task(snap: Snapshot, queue: str, task: str | None) -> Any:
    [found] = [t for t in snap.tasks if (t.queue, t.task) == (queue, task)]
    return found


def test_every_number_is_exact(populated: psycopg.Connection) -> None:
    snap = MetricsReader(lag=0).snapshot(populated)

    a = _task(snap, "q1", "t.a")
    assert (a.pending, a.scheduled, a.running, a.dead, a.completed, a.cancelled, a.expired) == \
        (5, 2, 3, 2, 4, 1, 2)
    assert a.redelivered == 1 + 1            # the requeued pending one, the running attempt 2
    assert a.poison == 1
    assert 120 <= a.oldest_pending_age < 120 + 600
    b = _task(snap, "q1", "t.b")
    assert (b.pending, b.dead, b.poison, b.completed) == (1, 1, 1, 0)
    assert 30 <= b.oldest_pending_age < 30 + 600
    plain = _task(snap, "q2", None)
    assert (plain.pending, plain.completed) == (5, 1)

    queues = {q.queue: q for q in snap.queues()}
    assert sorted(queues) == ["idle", "q1", "q2"]
    q1 = queues["q1"]
    assert (q1.pending, q1.dead, q1.poison, q1.consumers, q1.paused) == (6, 3, 2, 2, False)
    assert q1.oldest_pending_age == a.oldest_pending_age
    assert (queues["q2"].paused, queues["q2"].consumers, queues["q2"].pending) == (True, 1, 5)
    assert (queues["idle"].pending, queues["idle"].oldest_pending_age) == (0, None)
    assert snap.consumers_alive == 2
    assert snap.beat == {}


def test_prometheus_exposition_matches(populated: psycopg.Connection) -> None:
    reader = MetricsReader(lag=0)
    text = generate_latest(prometheus_registry(lambda: reader.snapshot(populated))).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("pgbroker_up") == 1
    assert value("pgbroker_jobs", queue="q1", task="t.a", state="pending") == 5
    assert value("pgbroker_jobs", queue="q1", task="t.a", state="completed") == 4
    assert value("pgbroker_jobs", queue="q1", task="t.a", state="dead") == 2
    assert value("pgbroker_jobs", queue="q2", task="", state="pending") == 5
    assert value("pgbroker_jobs_poison", queue="q1", task="t.b") == 1
    assert value("pgbroker_jobs_redelivered", queue="q1", task="t.a") == 2
    assert value("pgbroker_oldest_pending_age_seconds", queue="q1", task="t.a") >= 120
    assert value("pgbroker_queue_paused", queue="q2") == 1
    assert value("pgbroker_queue_paused", queue="q1") == 0
    assert value("pgbroker_queue_consumers", queue="q1") == 2
    assert value("pgbroker_consumers_alive") == 2


def test_finished_counts_are_incremental(pg: psycopg.Connection) -> None:
    add_jobs(pg, 3, "completed")
    reader = MetricsReader(lag=0)
    assert _task(reader.snapshot(pg), "q1", "t.a").completed == 3
    add_jobs(pg, 2, "completed")
    add_job(pg, "expired")
    snap = reader.snapshot(pg)
    assert (_task(snap, "q1", "t.a").completed, _task(snap, "q1", "t.a").expired) == (5, 1)
    # Proof that a later scrape reads only the new rows: a counted row deleted by hand stays
    # counted (the documented limit) ...
    pg.execute("DELETE FROM pgbroker.jobs WHERE id = (SELECT id FROM pgbroker.jobs"
               " WHERE state = 'completed' LIMIT 1)")
    assert _task(reader.snapshot(pg), "q1", "t.a").completed == 5
    # ... until the periodic full recount, and a new reader counts the window afresh.
    assert _task(MetricsReader(lag=0).snapshot(pg), "q1", "t.a").completed == 4
    assert _task(MetricsReader(lag=0, resync=0).snapshot(pg), "q1", "t.a").completed == 4


def test_finished_rows_leave_the_window(pg: psycopg.Connection) -> None:
    add_job(pg, "completed", updated_at=_ago(pg, 600))
    add_job(pg, "completed", updated_at=_ago(pg, 30))
    assert _task(MetricsReader(lag=0, window=300).snapshot(pg), "q1", "t.a").completed == 1
    assert _task(MetricsReader(lag=0, window=3600).snapshot(pg), "q1", "t.a").completed == 2


def test_rows_within_the_lag_are_counted_once(pg: psycopg.Connection) -> None:
    reader = MetricsReader(lag=3600)  # everything finished within the last hour is "recent"
    add_job(pg, "completed")
    assert _task(reader.snapshot(pg), "q1", "t.a").completed == 1
    assert _task(reader.snapshot(pg), "q1", "t.a").completed == 1  # read again, not added
    add_job(pg, "completed", updated_at=_ago(pg, 2 * 3600))  # before the watermark: kept
    add_job(pg, "completed")
    assert _task(reader.snapshot(pg), "q1", "t.a").completed == 3 - 1  # the old one is missed
    assert _task(MetricsReader(lag=0).snapshot(pg), "q1", "t.a").completed == 3


def add_beat_entry(pg: psycopg.Connection, name: str, completed_ago: float | None,
                   enabled: bool = True) -> None:
    """A beat entry as pgbroker.beat keeps it (migration 0004), last completed so long ago."""
    pg.execute("INSERT INTO pgbroker.beat_schedule (name, task, schedule, next_occurrence,"
               " enabled, last_completed_at) VALUES (%s, 'tasks.t', '{\"every\": 60}', now(), %s,"
               " now() - make_interval(secs => %s))", (name, enabled, completed_ago))


def test_beat_entry_ages(pg: psycopg.Connection) -> None:
    add_beat_entry(pg, "hourly", 90)
    add_beat_entry(pg, "never", None)
    add_beat_entry(pg, "switched-off", 5, enabled=False)
    beat = MetricsReader(lag=0).snapshot(pg).beat
    assert list(beat) == ["hourly", "never"]
    assert beat["never"] is None
    assert 90 <= beat["hourly"] < 90 + 600
    reader = MetricsReader(lag=0)
    text = generate_latest(prometheus_registry(lambda: reader.snapshot(pg))).decode()
    assert 'pgbroker_beat_last_run_age_seconds{entry="hourly"}' in text


def test_beat_status_missing_or_of_another_shape_is_skipped(
        pg: psycopg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    add_job(pg, "pending")
    pg.execute("DROP VIEW pgbroker.beat_status")
    reader = MetricsReader(lag=0)
    assert reader.snapshot(pg).beat == {}
    pg.execute("CREATE VIEW pgbroker.beat_status AS SELECT name FROM pgbroker.beat_schedule")
    snap = reader.snapshot(pg)
    assert snap.beat == {} and _task(snap, "q1", "t.a").pending == 1  # the rest still read
    assert reader.snapshot(pg).beat == {}
    assert sum("no beat ages" in r.getMessage() for r in caplog.records) == 1


def test_poison_rule_is_the_same_in_sql_and_python(pg: psycopg.Connection) -> None:
    errors = [LOST, CHILD_KILLED, CHILD_LOST, "ValueError: boom", "max attempts (5) reached; "
              "last: restored unacked", "consumer lost while running; redelivered", None]
    for error in errors:
        add_job(pg, "dead", last_error=error)
    counted = _task(MetricsReader(lag=0).snapshot(pg), "q1", "t.a").poison
    assert counted == sum(is_poison(e) for e in errors) == 3


# A Celery protocol-2 message as stored: ~1 KB a row with its headers, as in production.
_BENCH_INSERT = """
INSERT INTO pgbroker.jobs (id, queue, task, task_id, body, headers, properties, state, attempts,
                           updated_at, run_at)
SELECT gen_random_uuid(), 'q' || (i %% 4), 'task.' || (i %% 10), gen_random_uuid()::text,
       convert_to('[[' || i || ', "an argument of a typical size: x@example.com"], {},'
                  ' {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]', 'UTF8'),
       jsonb_build_object('lang', 'py', 'task', 'task.' || (i %% 10), 'id', gen_random_uuid(),
                          'shadow', null, 'eta', null, 'expires', null, 'group', null,
                          'retries', 0, 'timelimit', jsonb_build_array(null, null),
                          'root_id', gen_random_uuid(), 'parent_id', null,
                          'argsrepr', '(' || i || ', ''an argument'')', 'kwargsrepr', '{}',
                          'origin', 'gen1234@host-' || (i %% 7), 'ignore_result', false),
       '{"correlation_id": "x", "reply_to": "abc", "delivery_mode": 2, "priority": 0}',
       %(state)s, %(attempts)s,
       now() - make_interval(secs => i %% 80000),   -- finished over the last ~22 hours
       now() - make_interval(secs => i %% 600)
FROM generate_series(%(lo)s, %(hi)s) AS i
"""


@pytest.mark.bench
def test_bench_scrape_1m_completed_100k_pending(pg: psycopg.Connection) -> None:
    """Prints what a scrape costs with 1,000,000 completed + 100,000 pending rows (~1.3 GB)."""
    pg.execute("INSERT INTO pgbroker.queues (name) SELECT 'q' || i FROM generate_series(0, 3) i")
    began = time.perf_counter()
    for state, n in (("completed", 1_000_000), ("pending", 100_000)):
        for lo in range(0, n, 100_000):
            pg.execute(_BENCH_INSERT, {"state": state, "attempts": int(state == "completed"),
                                       "lo": lo, "hi": lo + 99_999})
    pg.execute("VACUUM ANALYZE pgbroker.jobs")
    size = pg.execute("SELECT pg_size_pretty(pg_total_relation_size('pgbroker.jobs'))").fetchone()
    print(f"\nloaded 1,100,000 rows ({size[0]}) in {time.perf_counter() - began:.0f} s")

    def pages() -> int:
        """8 kB pages of the jobs table and its indexes read so far (hit or from disk)."""
        pg.execute("SELECT pg_stat_force_next_flush()")
        return pg.execute("SELECT sum(heap_blks_read + heap_blks_hit + idx_blks_read"
                          " + idx_blks_hit) FROM pg_statio_user_tables WHERE relid IN"
                          " (SELECT relid FROM pg_partition_tree('pgbroker.jobs'))"
                          ).fetchone()[0]

    def timed(what: str, fn: Any, runs: int) -> None:
        times = []
        before = pages()
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        read = (pages() - before) // runs
        print(f"{what}: median {sorted(times)[len(times) // 2]:.0f} ms, {read} pages "
              f"(runs: {', '.join(f'{t:.0f}' for t in times)} ms)")

    naive = "SELECT queue, task, state, count(*) FROM pgbroker.jobs GROUP BY queue, task, state"
    timed("naive GROUP BY over the table         ", lambda: pg.execute(naive).fetchall(), 3)
    timed("first scrape (counts the whole window)",
          lambda: MetricsReader(lag=0).snapshot(pg), 3)
    reader = MetricsReader(lag=0)
    reader.snapshot(pg)
    timed("later scrape (incremental)            ", lambda: reader.snapshot(pg), 7)
    snap = reader.snapshot(pg)
    assert sum(q.completed for q in snap.queues()) == 1_000_000
    assert sum(q.pending for q in snap.queues()) == 100_000

    # The healthy case: the same million finished rows, a backlog of 1,000.
    pg.execute("DELETE FROM pgbroker.jobs WHERE state = 'pending' AND id NOT IN"
               " (SELECT id FROM pgbroker.jobs WHERE state = 'pending' LIMIT 1000)")
    pg.execute("VACUUM ANALYZE pgbroker.jobs")
    print("with 1,000 pending:")
    timed("naive GROUP BY over the table         ", lambda: pg.execute(naive).fetchall(), 3)
    timed("later scrape (incremental)            ", lambda: reader.snapshot(pg), 7)
    assert sum(q.pending for q in reader.snapshot(pg).queues()) == 1000


def test_celery_internal_queues_are_left_out_unless_asked(pg: psycopg.Connection) -> None:
    pg.execute("INSERT INTO pgbroker.queues (name) VALUES ('celery'), ('w1@host.celery.pidbox'),"
               " ('0f3c.reply.celery.pidbox'), ('celeryev.4a2b')")
    add_job(pg, "pending", queue="0f3c.reply.celery.pidbox", task=None)
    snap = MetricsReader(lag=0).snapshot(pg)
    assert [q.queue for q in snap.queues()] == ["celery"]
    assert (snap.tasks, snap.hidden) == ([], 3)
    everything = MetricsReader(lag=0, include_internal=True).snapshot(pg)
    assert len(everything.queues()) == 4 and everything.hidden == 0
