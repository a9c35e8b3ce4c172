"""A paused task name's backlog waits out of the claim's way (0011_task_pause_index.sql), and its
resume gives back exactly the jobs that waited, unchanged and in their order.

Every publish path marks a job of a paused name as it inserts it (``pgbroker.enqueue``:
job_insert, ``enqueue_many``: job_insert_many, a kombu publish through an exchange:
job_fanout); the pause marks the waiting ones, the automatic pause too; a dead job retried while
its task is paused waits with them; a job marked by a transaction that read the pause before a
resume committed is given back by the sweeper. The claim's own reading is counted with EXPLAIN
ANALYZE: the rows its index scan reads and throws away.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import kombu
import psycopg
from psycopg.rows import dict_row

import pgbroker
from pgbroker._model.claimed import after_params
from pgbroker._pg.catalogue import queries
from pgbroker.migrate import MIGRATIONS, apply
from pgbroker.ops import Operations
from pgbroker.sweeper import Sweeper
from tests.integration.test_sweeper_log import lost_consumer
from tests.support.transport import store_for
from tests.support.db import add_job

PAUSED, OTHER = "t.paused", "t.other"
#: every column a job's message and its place in the queue are made of
COLUMNS = ("id, queue, task, task_id, retries, exchange, routing_key, body, content_type, "
           "content_encoding, headers, properties, state, priority, attempts, max_attempts, "
           "run_at, expires_at, idempotency_key, created_at, updated_at")


def _ops(conn: psycopg.Connection) -> Operations:
    return Operations(conn, actor="alice", via="test")


def _waiting(pg: psycopg.Connection, task: str) -> list[dict[str, Any]]:
    """The task's waiting jobs, in the order the claim takes them."""
    with pg.cursor(row_factory=dict_row) as cur:
        return cur.execute(f"SELECT {COLUMNS} FROM pgbroker.jobs WHERE task = %s "
                           "AND state IN ('pending', 'scheduled') "
                           "ORDER BY priority DESC, run_at, id", (task,)).fetchall()


def _claim_reads(pg: psycopg.Connection, queue: str) -> tuple[int, int]:
    """(rows the claim took, rows its scan of jobs read and threw away), by EXPLAIN ANALYZE of
    job_claim in a transaction rolled back."""
    claim = queries("pgbroker")["job_claim"]
    params = {"queue": queue, "limit": 10, "consumer": uuid.uuid4(), "ids": [], "attempts": [],
              **after_params()}
    with pg.transaction(force_rollback=True):
        plan = pg.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + claim, params).fetchone()[0][0]

    def nodes(p: dict[str, Any]) -> list[dict[str, Any]]:
        return [p] + [n for c in p.get("Plans", []) for n in nodes(c)]

    cte = next(n for n in nodes(plan["Plan"]) if n.get("Subplan Name") == "CTE candidates")
    scans = [n for n in nodes(cte) if n.get("Relation Name") == "jobs_live"]
    assert len(scans) == 1, scans
    return scans[0]["Actual Rows"], scans[0].get("Rows Removed by Filter", 0)


def _claim_all(store: Any, queue: str) -> list[uuid.UUID]:
    consumer, acks, taken = uuid.uuid4(), [], []
    while rows := store.claim(queue, 7, consumer, acks):
        taken += [r.id for r in rows]
        acks = [(r.id, r.attempt) for r in rows]
    store.ack(acks)
    return taken


def test_a_paused_backlog_is_not_read_by_the_claim_and_comes_back_unchanged_in_order(
        db_url: str, pg: psycopg.Connection, broker_url: str) -> None:
    now = pg.execute("SELECT now()").fetchone()[0]
    store = store_for(db_url)
    try:
        # the head of q1: 400 jobs of the paused name (mixed priorities), older than the rest
        for i in range(400):
            add_job(pg, "pending", task=PAUSED, priority=i % 3, task_id=f"p{i}",
                    run_at=now - timedelta(hours=2, seconds=-i), headers=f'{{"n": {i}}}')
        add_job(pg, "scheduled", task=PAUSED, run_at=now + timedelta(hours=1))
        others = [add_job(pg, "pending", task=OTHER, run_at=now - timedelta(hours=1, seconds=-i))
                  for i in range(30)]
        assert _claim_reads(pg, "q1")[1] == 0      # nothing paused: nothing read in vain
        with psycopg.connect(db_url, autocommit=True) as conn:
            assert _ops(conn).pause_task(PAUSED, "a leak")
            # published while paused, by each insert statement
            pgbroker.enqueue(conn, PAUSED, (1,), queue="q1")
            pgbroker.enqueue_many(conn, [(PAUSED, (2,), {}, {"queue": "q1"}),
                                         (OTHER, (3,), {}, {"queue": "q1"})])
            with kombu.Connection(broker_url) as kconn:
                exchange = kombu.Exchange("ex", type="direct")
                kombu.Queue("q1", exchange, routing_key="k")(kconn.default_channel).declare()
                kombu.Producer(kconn.default_channel).publish(
                    {"n": 4}, exchange=exchange, routing_key="k", serializer="json",
                    headers={"task": PAUSED, "id": str(uuid.uuid4())})
        waited = _waiting(pg, PAUSED)
        assert len(waited) == 404
        taken, thrown = _claim_reads(pg, "q1")
        assert (taken, thrown) == (10, 0), "the claim read the paused backlog"
        assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_paused").fetchone() == (
            404,)
        claimed = _claim_all(store, "q1")
        assert len(claimed) == 31 and set(others) <= set(claimed)
        assert _waiting(pg, PAUSED) == waited      # not one waiting job changed
        with psycopg.connect(db_url, autocommit=True) as conn:
            assert [p["waiting"] for p in _ops(conn).paused_tasks()] == [403]  # (one scheduled)
            assert _ops(conn).resume_task(PAUSED, "fixed")
        assert _waiting(pg, PAUSED) == waited      # the resume changed nothing but the marker
        assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_paused").fetchone() == (
            0,)
        pending = [w["id"] for w in waited if w["state"] == "pending"]
        assert _claim_all(store, "q1") == pending  # all of them, in their order
    finally:
        store.close()
    audit = pg.execute("SELECT actor, action, detail->>'reason' FROM pgbroker.audit "
                       "WHERE target = %s ORDER BY id", (PAUSED,)).fetchall()
    assert audit == [("alice", "task.pause", "a leak"), ("alice", "task.resume", "fixed")]


def test_the_automatic_pause_and_a_retried_dead_job_wait_out_of_the_claims_way(
        db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url, pause_task_after=2)
    try:
        backlog = [add_job(pg, "pending", task=PAUSED) for _ in range(50)]
        for host in ("host-1", "host-2"):
            add_job(pg, "running", task=PAUSED, locked_by=lost_consumer(pg, host))
        dead = add_job(pg, "dead", task=PAUSED, attempts=5, max_attempts=5)
        assert Sweeper(store).run_once().rescued == 2   # two different workers lost: paused
        marked = {r[0] for r in pg.execute(
            "SELECT id FROM pgbroker.jobs WHERE task_paused AND state = 'pending'")}
        assert set(backlog) <= marked and len(marked) == 52   # the rescued ones too
        with psycopg.connect(db_url, autocommit=True) as conn:
            _ops(conn).retry_dead(dead)
        assert pg.execute("SELECT state, task_paused FROM pgbroker.jobs WHERE id = %s",
                          (dead,)).fetchone() == ("pending", True)
        assert _claim_reads(pg, "q1") == (0, 0)
    finally:
        store.close()


def test_a_job_marked_by_a_transaction_that_read_the_pause_before_a_resume_is_given_back(
        db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url)
    try:
        with psycopg.connect(db_url, autocommit=True) as conn:
            _ops(conn).pause_task(PAUSED)
            with psycopg.connect(db_url) as late:            # its transaction reads the pause
                job = pgbroker.enqueue(late, PAUSED, queue="q1")
                assert _ops(conn).resume_task(PAUSED)        # ... before this commits
                late.commit()
        assert pg.execute("SELECT task_paused FROM pgbroker.jobs WHERE id = %s",
                          (job,)).fetchone() == (True,)
        assert Sweeper(store).run_once().promoted == 1
        assert _claim_all(store, "q1") == [job]
    finally:
        store.close()


def test_the_migration_marks_the_jobs_of_a_task_paused_before_it_and_lets_producers_read(
        db_url: str, pg: psycopg.Connection) -> None:
    """A schema at 0010 with a task paused: 0011 takes its waiting jobs out of the claim's way,
    and a role that could insert jobs (a producer set up by roles.sql.example before 0011) may
    read task_pauses, which the insert now reads."""
    schema, role = "upgrade_0011", f"pgbroker_test_producer_0011_{uuid.uuid4().hex[:8]}"
    apply(db_url, schema, MIGRATIONS[:10])
    pg.execute(f"CREATE ROLE {role}")
    try:
        pg.execute(f"GRANT INSERT ON {schema}.jobs TO {role}")
        pg.execute(f"INSERT INTO {schema}.task_pauses (task, paused_by, reason) "
                   f"VALUES ('{PAUSED}', 'alice', 'a leak')")
        for state, task in (("pending", PAUSED), ("scheduled", PAUSED), ("dead", PAUSED),
                            ("pending", OTHER)):
            pg.execute(f"INSERT INTO {schema}.jobs (id, queue, task, body, state) "
                       "VALUES (gen_random_uuid(), 'q1', %s, '', %s)", (task, state))
        assert apply(db_url, schema, MIGRATIONS) == [m.version for m in MIGRATIONS[10:]]
        assert pg.execute(f"SELECT state, task FROM {schema}.jobs WHERE task_paused "
                          "ORDER BY state").fetchall() == [("pending", PAUSED),
                                                           ("scheduled", PAUSED)]
        assert pg.execute("SELECT has_table_privilege(%s, %s, 'SELECT')",
                          (role, f"{schema}.task_pauses")).fetchone() == (True,)
    finally:
        pg.execute(f"DROP SCHEMA {schema} CASCADE")
        pg.execute(f"DROP OWNED BY {role}")
        pg.execute(f"DROP ROLE {role}")
