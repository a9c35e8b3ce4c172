"""Finished jobs leave the hot table (issue 26, migration 0020_finished_partition.sql).

``jobs`` is partitioned by state: ``jobs_live`` (scheduled, pending, running) and ``jobs_done``
(completed, cancelled, expired, dead). These tests show that an ack moves the row out of the
table every claim reads, and that what the single table guaranteed through its unique indexes
still holds across the two partitions: an idempotency key (job_keys), a message published again
(the insert statements' look into jobs_done), a dead letter retried back into jobs_live; that a
statement meeting a row moved under it is sent again; and that the migration turns a live
schema of 0019 into the partitioned one with every job, key and privilege kept.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from pgbroker._model.job import NewJob, batch_lists
from pgbroker._pg.catalogue import queries
from pgbroker._pg.store import Store
from pgbroker.migrate import MIGRATIONS, apply
from pgbroker.ops import Operations
from tests.support.transport import new_job, store_for
from tests.support.processes import wait_for

CONSUMER = uuid.uuid4()


@pytest.fixture
def store(db_url: str) -> Any:
    s = store_for(db_url)
    yield s
    s.close()


def where(pg: psycopg.Connection, schema: str = "pgbroker") -> dict[str, int]:
    """How many rows each partition holds."""
    return dict(pg.execute(f"SELECT tableoid::regclass::text, count(*) FROM {schema}.jobs"
                           " GROUP BY 1").fetchall())


def run(store: Store, queue: str = "q1") -> list[uuid.UUID]:
    """Claim every due job of ``queue`` and ack it; the ids."""
    done: list[uuid.UUID] = []
    while rows := store.claim(queue, 100, CONSUMER):
        store.ack([(r.id, r.attempt) for r in rows])
        done += [r.id for r in rows]
    return done


def keyed(key: str, **fields: Any) -> NewJob:
    return new_job("q1", {"n": key}, task="t.a", task_id=str(uuid.uuid4()),
                   idempotency_key=key, **fields)


def test_an_acked_job_leaves_the_table_the_claim_reads(store: Store,
                                                       pg: psycopg.Connection) -> None:
    store.insert_many([new_job("q1", n, task="t.a", task_id=str(uuid.uuid4()))
                       for n in range(50)])
    assert where(pg) == {"pgbroker.jobs_live": 50}
    assert len(run(store)) == 50
    assert where(pg) == {"pgbroker.jobs_done": 50}
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE state = 'completed'"
                      ).fetchone() == (50,)


def test_an_idempotency_key_holds_across_the_partitions_until_its_job_is_pruned(
        db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url, retention=60.0)
    try:
        first = keyed("k1")
        store.insert(first)
        assert run(store) == [first.id]
        assert where(pg) == {"pgbroker.jobs_done": 1}
        again = keyed("k1")
        store.insert(again)                      # finished, but the key is still its job's
        assert pg.execute("SELECT id FROM pgbroker.jobs").fetchall() == [(first.id,)]
        assert store.prune(now=datetime.now(timezone.utc) + timedelta(hours=1)) == 1
        assert pg.execute("SELECT count(*) FROM pgbroker.job_keys").fetchone() == (0,)
        store.insert(again)                      # pruned: the key is free
        assert pg.execute("SELECT id FROM pgbroker.jobs").fetchall() == [(again.id,)]
    finally:
        store.close()


def test_a_key_whose_job_is_gone_is_taken_by_the_next_publish(store: Store,
                                                              pg: psycopg.Connection) -> None:
    store.insert(keyed("k2"))
    pg.execute("TRUNCATE pgbroker.jobs")  # no row trigger runs: the key row stays behind
    assert pg.execute("SELECT count(*) FROM pgbroker.job_keys").fetchone() == (1,)
    later = keyed("k2")
    store.insert(later)
    assert pg.execute("SELECT id FROM pgbroker.jobs").fetchall() == [(later.id,)]
    assert pg.execute("SELECT id FROM pgbroker.job_keys").fetchall() == [(later.id,)]


def test_a_keyed_publish_waits_for_one_of_the_same_key_in_flight(
        db_url: str, pg: psycopg.Connection) -> None:
    insert = ("INSERT INTO pgbroker.jobs (id, queue, task, body, idempotency_key)"
              " VALUES (%s, 'q1', 't.a', '', 'k3') ON CONFLICT DO NOTHING RETURNING id")
    first, second = uuid.uuid4(), uuid.uuid4()
    results: list[Any] = []
    with psycopg.connect(db_url) as a, psycopg.connect(db_url, autocommit=True) as b:
        assert a.execute(insert, (first,)).fetchall() == [(first,)]
        racer = threading.Thread(target=lambda: results.append(
            b.execute(insert, (second,)).fetchall()))
        racer.start()
        # it waits for the first publish's transaction (a lock, as pg_stat_activity says)
        wait_for(lambda: pg.execute("SELECT wait_event_type FROM pg_stat_activity"
                                    " WHERE pid = %s", (b.info.backend_pid,)).fetchone()
                 == ("Lock",), 10, message="the second publish waiting for the first")
        assert racer.is_alive()
        a.commit()
        racer.join(10)
    assert results == [[]]      # then inserts nothing, as ON CONFLICT DO NOTHING did
    assert pg.execute("SELECT id FROM pgbroker.jobs").fetchall() == [(first,)]


def test_a_message_published_again_after_its_job_finished_is_skipped(
        store: Store, pg: psycopg.Connection) -> None:
    job = new_job("q1", {"a": 1}, task="t.a", task_id=str(uuid.uuid4()))
    store.insert(job)
    run(store)
    store.insert(job)                                        # the same publish, sent again
    store.insert_many([dataclasses.replace(job, id=uuid.uuid4())])  # or with a new id
    assert pg.execute("SELECT id, state FROM pgbroker.jobs").fetchall() == [(job.id, "completed")]
    # counted once: the same id is the job itself (job_enqueued_ids' "own")
    assert pg.execute("SELECT sum(duplicates)::int FROM pgbroker.publish_duplicates"
                      ).fetchone() == (1,)


def test_a_dead_letter_retried_moves_back_with_its_key(db_url: str, store: Store,
                                                      pg: psycopg.Connection) -> None:
    job = keyed("k4")
    store.insert(job)
    (row,) = store.claim("q1", 1, CONSUMER)
    assert store.bury(row.id, row.attempt, "boom") == 1
    assert where(pg) == {"pgbroker.jobs_done": 1}
    with psycopg.connect(db_url, autocommit=True) as conn:
        Operations(conn, actor="t", via="test").retry_dead(job.id)
    assert where(pg) == {"pgbroker.jobs_live": 1}
    assert pg.execute("SELECT id FROM pgbroker.job_keys").fetchall() == [(job.id,)]
    store.insert(keyed("k4"))                                # still its key
    assert run(store) == [job.id]


def test_a_statement_that_meets_a_moved_row_is_sent_again(store: Store,
                                                         pg: psycopg.Connection) -> None:
    """Under READ COMMITTED, locking a row that another session moved to the other partition
    after the statement's snapshot fails with 40001 (a revoke or an expiry of a pending job
    while a claim runs): the statement, rolled back whole, is sent again. The fault is made
    deterministic by a trigger that raises it once."""
    pg.execute("CREATE SEQUENCE public.once")
    pg.execute("""CREATE FUNCTION public.moved_once() RETURNS trigger LANGUAGE plpgsql AS $$
                  BEGIN
                      IF nextval('public.once') = 1 THEN
                          RAISE EXCEPTION 'tuple to be locked was already moved to another'
                              ' partition due to concurrent update' USING ERRCODE = '40001';
                      END IF;
                      RETURN NEW;
                  END $$""")
    pg.execute("CREATE TRIGGER moved_once BEFORE UPDATE ON pgbroker.jobs_live"
               " FOR EACH ROW EXECUTE FUNCTION public.moved_once()")
    job = new_job("q1", 1, task="t.a")
    store.insert(job)
    assert [r.id for r in store.claim("q1", 1, CONSUMER)] == [job.id]
    assert pg.execute("SELECT nextval('public.once')").fetchone() == (3,)  # failed once


def test_the_migration_partitions_a_live_schema_keeping_jobs_keys_and_privileges(
        db_url: str, pg: psycopg.Connection) -> None:
    schema, role = "upgrade_0020", f"pgbroker_test_producer_0020_{uuid.uuid4().hex[:8]}"
    apply(db_url, schema, MIGRATIONS[:19])
    pg.execute(f"CREATE ROLE {role}")
    try:
        pg.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        pg.execute(f"GRANT INSERT ON {schema}.jobs TO {role}")
        pg.execute(f"GRANT SELECT (id, queue, task, task_id, state, idempotency_key,"
                   f" message_digest) ON {schema}.jobs TO {role}")
        pg.execute(f"INSERT INTO {schema}.concurrency_keys (key, running) VALUES ('ck', 1)")
        states = ("pending", "scheduled", "running", "completed", "dead", "cancelled",
                  "expired")
        ids = {}
        for state in states:
            ids[state] = pg.execute(
                f"INSERT INTO {schema}.jobs (id, queue, task, body, state, locked_by,"
                " idempotency_key, concurrency_key, concurrency_limit)"
                " VALUES (gen_random_uuid(), 'q1', 't.a', '', %s, gen_random_uuid(), %s, %s,"
                " %s) RETURNING id",
                (state, f"key-{state}", "ck" if state == "running" else None,
                 1 if state == "running" else None)).fetchone()[0]
        assert apply(db_url, schema, MIGRATIONS) == [20]

        live = {"pending", "scheduled", "running"}
        assert dict(pg.execute(f"SELECT id, tableoid::regclass::text FROM {schema}.jobs"
                               ).fetchall()) == {
            ids[s]: f"{schema}.jobs_{'live' if s in live else 'done'}" for s in states}
        assert dict(pg.execute(f"SELECT idempotency_key, id FROM {schema}.job_keys"
                               ).fetchall()) == {f"key-{s}": ids[s] for s in states}
        # the move did not give the running job's slot back
        assert pg.execute(f"SELECT running FROM {schema}.concurrency_keys").fetchone() == (1,)
        assert pg.execute(f"SELECT has_table_privilege(%s, '{schema}.jobs', 'INSERT'),"
                          f" has_column_privilege(%s, '{schema}.jobs', 'message_digest', 'SELECT')",
                          (role, role)).fetchone() == (True, True)
        # a producer's publish of a key whose job finished inserts nothing
        with psycopg.connect(db_url, autocommit=True) as producer:
            producer.execute(f"SET ROLE {role}")
            assert producer.execute(
                f"INSERT INTO {schema}.jobs (id, queue, task, body, idempotency_key)"
                " VALUES (gen_random_uuid(), 'q1', 't.a', '', 'key-completed')"
                " ON CONFLICT DO NOTHING").rowcount == 0
        # the running job's ack moves it and gives its slot back, once
        pg.execute(f"UPDATE {schema}.jobs SET state = 'completed' WHERE id = %s",
                   (ids["running"],))
        assert pg.execute(f"SELECT running FROM {schema}.concurrency_keys").fetchone() == (0,)
    finally:
        pg.execute(f"DROP SCHEMA {schema} CASCADE")
        pg.execute(f"DROP OWNED BY {role}")
        pg.execute(f"DROP ROLE {role}")


def _done_reads(pg: psycopg.Connection) -> tuple[int, int]:
    """(heap, index) blocks of jobs_done read so far (hit or not)."""
    pg.execute("SELECT pg_stat_clear_snapshot()")
    return pg.execute("SELECT heap_blks_read + heap_blks_hit, idx_blks_read + idx_blks_hit"
                      " FROM pg_statio_user_tables WHERE relid = 'pgbroker.jobs_done'::regclass"
                      ).fetchone()


def test_a_publish_probes_jobs_done_whatever_plan_its_connection_cached(
        db_url: str, pg: psycopg.Connection) -> None:
    """A producer's connection caches the insert's plan (psycopg prepares it; PostgreSQL keeps a
    generic plan) while jobs_done is empty; a day of finished jobs later, the look for a message
    already finished must still be index probes, not a read of jobs_done (jobs_finished_ids,
    0020: the pressure benchmark measured a NOT EXISTS in the statement at 15 ms and 1,982
    buffers a publish after a minute). The check can fail: the same look as a NOT EXISTS of the
    statement, planned without index scans, reads all of jobs_done."""
    pg.execute("VACUUM ANALYZE pgbroker.jobs_done")  # its statistics: empty
    text = queries("pgbroker")["job_insert_many"]
    inline = text.replace(
        "WHERE m.id <> ALL ((SELECT",
        "WHERE NOT EXISTS (SELECT 1 FROM \"pgbroker\".jobs AS d WHERE d.state = 'completed'"
        " AND d.task_id = m.task_id AND d.queue = m.queue AND d.message_digest = m.message_digest)"
        " AND m.id <> ALL ((SELECT")
    assert inline != text

    def publish(conn: psycopg.Connection, statement: str) -> None:
        jobs = [new_job("q1", n, task="t.a", task_id=str(uuid.uuid4())) for n in range(5)]
        conn.execute(statement, batch_lists(jobs, "pgbroker.jobs"), prepare=True, binary=True)
        # its reads reach the shared statistics as this session goes idle after the call (a
        # call before the publish is spent on its own statement: the publish's reads then
        # waited for the next flush, up to 10 s later, and the check read nothing)
        conn.execute("SELECT pg_stat_force_next_flush()")

    with psycopg.connect(db_url, autocommit=True) as ours, \
            psycopg.connect(db_url, autocommit=True) as theirs:
        for conn in (ours, theirs):
            conn.execute("SET plan_cache_mode = force_generic_plan")
        theirs.execute("SET enable_indexscan = off")
        theirs.execute("SET enable_bitmapscan = off")
        for _ in range(2):  # prepared, its plan made on an empty jobs_done
            publish(ours, text)
            publish(theirs, inline)
        pg.execute("INSERT INTO pgbroker.jobs (id, queue, task, task_id, body, state)"
                   " SELECT gen_random_uuid(), 'q1', 't.a', 'done-' || g, '\\x00', 'completed'"
                   " FROM generate_series(1, 50000) AS g")
        pg.execute("SELECT pg_stat_force_next_flush()")  # its reads counted before ours
        pages = pg.execute("SELECT pg_relation_size('pgbroker.jobs_done') / 8192").fetchone()[0]
        before = _done_reads(pg)
        publish(ours, text)
        heap, index = (a - b for a, b in zip(_done_reads(pg), before))
        assert index > 0 and heap < 10, (heap, index)  # index probes, no heap page
        before = _done_reads(pg)
        publish(theirs, inline)
        heap = _done_reads(pg)[0] - before[0]
    assert heap >= pages // 2, (heap, pages)  # the whole table, at each publish
