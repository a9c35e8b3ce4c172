"""The claim starts where the last one ended (issue 26, 0014_claim_cursor.sql), on a real server.

* While a snapshot is held (VACUUM may remove no dead row version, nor may an index scan mark
  one dead), 50,000 jobs go through a real kombu consumer: the claim statement's buffer reads,
  from EXPLAIN (ANALYZE, BUFFERS) at the consumer's own starting place, stay flat, where the
  same claim from the head of the queue (every claim before 0014) reads them all.
* Rows that become pending behind the cursor -- a transaction that commits late, a higher
  priority, a requeue, a promoted eta -- are claimed at once, woken by their NOTIFY alone (no
  poll).
* The promotion of scheduled jobs (countdown, eta, retries) keeps a cursor of its own, with the
  same guarantees.
* The statements that settle deliveries (ack, requeue, bury) and promote jobs find their rows by
  primary key under the generic plan a worker's connection caches, however many dead versions
  a held snapshot keeps in jobs_live.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import kombu
import psycopg
import pytest
from psycopg import sql

from pgbroker._model.claimed import EARLIEST, HEAD, Position, after_params

from pgbroker._consume.claim_policy import ClaimPolicy
from pgbroker._model.job import row_params
from pgbroker._pg.catalogue import queries
from pgbroker._pg.store import Store
from pgbroker.settings import Settings
from tests.support.transport import (NO_POLL, LoopConsumer, connect, db_now,
                                                 drain_until, new_job, publish, store_for)

QUEUE = "cursor"


@pytest.fixture
def held_snapshot(db_url: str) -> Iterator[None]:
    """A transaction that holds the xmin horizon, as a report, pg_dump or a forgotten BEGIN."""
    with psycopg.connect(db_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT txid_current(), count(*) FROM pgbroker.jobs")
        yield
        holder.rollback()


def claim_buffers(pg: psycopg.Connection, after: Position) -> int:
    """Shared buffers job_claim reads to take 10 jobs of QUEUE after ``after`` (rolled back)."""
    params = {"queue": QUEUE, "limit": 10, "consumer": uuid.uuid4(), "ids": [], "attempts": [],
              **after_params(after)}
    with pg.transaction(force_rollback=True):
        plan = pg.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                          + queries("pgbroker")["job_claim"], params).fetchone()[0][0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def ack_buffers(pg: psycopg.Connection, store: Store) -> int:
    """Shared buffers job_ack reads to ack one running delivery of QUEUE (rolled back)."""
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid) VALUES (%s, 'ack', 1)", (consumer,))
    store.insert(new_job(QUEUE, "ack me"))
    [row] = store.claim(QUEUE, 1, consumer)
    with pg.transaction(force_rollback=True):
        plan = pg.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                          + queries("pgbroker")["job_ack"],
                          {"ids": [row.id], "attempts": [row.attempt]}).fetchone()[0][0]["Plan"]
    store.ack([(row.id, row.attempt)])
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_the_claim_reads_no_more_while_a_held_snapshot_keeps_50000_dead_versions(
        db_url: str, broker_url: str, pg: psycopg.Connection, held_snapshot: None) -> None:
    rounds, batch = 500, 100
    store = store_for(db_url)
    done: list[Any] = []
    measured: dict[int, tuple[int, int]] = {}
    acks: dict[int, int] = {}
    with connect(broker_url, **NO_POLL) as conn:
        channel = conn.channel()
        consumer = kombu.Consumer(channel, [kombu.Queue(QUEUE)], accept=["json"],
                                  callbacks=[lambda body, message: (done.append(1),
                                                                    message.ack())],
                                  prefetch_count=10)
        consumer.consume()
        try:
            for n in range(rounds):
                jobs = [new_job(QUEUE, n) for _ in range(batch)]
                store.insert_many(jobs)
                if n in (50, rounds - 1):
                    # where the consumer's next claim starts once it has read the NOTIFY
                    first = pg.execute("SELECT run_at FROM pgbroker.jobs WHERE id = %s",
                                       (jobs[0].id,)).fetchone()[0]
                    here: Position = (0, first, uuid.UUID(int=0))
                    measured[n] = (claim_buffers(pg, here), claim_buffers(pg, HEAD))
                    acks[n] = ack_buffers(pg, store)
                drain_until(conn, lambda: len(done) == (n + 1) * batch,
                            what=lambda: f"{len(done)} of {(n + 1) * batch} delivered")
        finally:
            store.close()
    dead = pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE state = 'completed'").fetchone()
    assert dead[0] == rounds * batch + 2  # (and the two acked by ack_buffers)
    (early, early_head), (late, late_head) = measured[50], measured[rounds - 1]
    print(f"\nclaim buffers after 5,000 / 50,000 jobs: cursor {early} / {late}, "
          f"from the head {early_head} / {late_head}; an ack {acks[50]} / {acks[rounds - 1]}")
    # flat: the 45,000 claimed rows in between are never read again ...
    assert late <= 1.25 * early + 10, measured
    # ... where a claim from the head reads every one of them: the snapshot held them all
    assert late_head >= 4 * early_head and late_head >= 10 * late, measured
    # an ack (job_ack, sent alone when nothing is to be claimed) reads its rows by primary key,
    # never the running index's dead entries
    assert acks[rounds - 1] <= 1.25 * acks[50] + 10, acks


@pytest.fixture
def loop(broker_url: str) -> Iterator[LoopConsumer]:
    """A worker-like consumer on an event loop, prefetch 1, woken by NOTIFY alone (no poll): a
    claim of one row fills its batch, so its cursor stays on that row."""
    with connect(broker_url, **NO_POLL) as conn:
        yield LoopConsumer(conn, QUEUE, prefetch=1)


def test_a_job_whose_transaction_commits_after_later_jobs_were_claimed_is_claimed(
        loop: LoopConsumer, broker_url: str, db_url: str) -> None:
    with psycopg.connect(db_url) as late, connect(broker_url) as producer:
        late.execute("SELECT now()")  # its jobs' run_at: this transaction's start
        publish(producer, "after", QUEUE)
        loop.run_until(lambda: len(loop.received) == 1)
        params = {**row_params(new_job(QUEUE, "before")), "channel": Settings().channel}
        late.execute(queries("pgbroker")["job_insert"], params)
        late.commit()
        loop.run_until(lambda: len(loop.received) == 2)
    assert [m.payload for m in loop.received] == ["after", "before"]


def test_a_higher_priority_job_is_claimed_before_the_cursor(loop: LoopConsumer,
                                                            broker_url: str) -> None:
    with connect(broker_url) as producer:
        for body in ("one", "two"):
            publish(producer, body, QUEUE)
            loop.run_until(lambda: loop.received and loop.received[-1].payload == body)
        publish(producer, "urgent", QUEUE, priority=9)
        loop.run_until(lambda: len(loop.received) == 3)
    assert loop.received[-1].payload == "urgent"


def test_a_requeued_job_goes_back_behind_the_cursor_and_is_claimed(broker_url: str) -> None:
    with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
        loop = LoopConsumer(conn, QUEUE, prefetch=1, ack=False)
        publish(producer, "again", QUEUE)
        loop.run_until(lambda: len(loop.received) == 1)
        publish(producer, "later", QUEUE)
        loop.received[0].requeue()
        loop.run_until(lambda: len(loop.received) == 2)
        loop.received[1].ack()
        loop.run_until(lambda: len(loop.received) == 3)
        loop.received[2].ack()
    # redelivered first: its place (its run_at) is before the later job's
    assert [m.payload for m in loop.received] == ["again", "again", "later"]


def test_a_promoted_eta_job_is_claimed(loop: LoopConsumer, db_url: str,
                                       pg: psycopg.Connection) -> None:
    store = store_for(db_url)
    try:
        store.insert(new_job(QUEUE, "first"))
        loop.run_until(lambda: len(loop.received) == 1)
        store.insert(new_job(QUEUE, "eta", run_at=db_now(pg) + timedelta(seconds=0.5)))
        store.insert(new_job(QUEUE, "now"))
        loop.run_until(lambda: len(loop.received) == 3)
    finally:
        store.close()
    assert [m.payload for m in loop.received] == ["first", "now", "eta"]


def test_the_drain_path_keeps_a_cursor_too(broker_url: str, db_url: str) -> None:
    """``drain_events`` (plain kombu, celery inspect) claims with the same policy."""
    received: list[Any] = []
    with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
        channel = conn.channel()
        consumer = kombu.Consumer(channel, [kombu.Queue(QUEUE)], accept=["json"],
                                  callbacks=[lambda body, m: (received.append(body), m.ack())],
                                  prefetch_count=1)
        consumer.consume()
        publish(producer, "a", QUEUE)
        drain_until(conn, lambda: len(received) == 1)
        policy: ClaimPolicy = channel.claims
        assert policy.after(QUEUE) != HEAD  # past "a"
        publish(producer, "b", QUEUE, priority=5)
        drain_until(conn, lambda: len(received) == 2)
    assert received == ["a", "b"]


def test_store_claim_takes_only_the_rows_after_its_place(store: Store, pg: psycopg.Connection
                                                         ) -> None:
    jobs = [new_job(QUEUE, n) for n in range(4)]
    store.insert_many(jobs)
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid) VALUES (%s, 'test', 1)",
               (consumer,))
    first = store.claim(QUEUE, 2, consumer)
    assert [r.id for r in first] == [j.id for j in jobs[:2]]
    last = first[-1]
    rest = store.claim(QUEUE, 10, consumer, after=(-last.priority, last.run_at, last.id))
    assert [r.id for r in rest] == [j.id for j in jobs[2:]]


def promote_buffers(pg: psycopg.Connection, after: datetime) -> int:
    """Shared buffers job_promote reads to promote QUEUE's due jobs from ``after`` (rolled back)."""
    params = {"queues": [QUEUE], "limit": 1000, "channel": Settings().channel, "after": after}
    with pg.transaction(force_rollback=True):
        plan = pg.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                          + queries("pgbroker")["job_promote"], params).fetchone()[0][0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_promotions_read_no_more_while_a_held_snapshot_keeps_20000_promoted_versions(
        store: Store, pg: psycopg.Connection, held_snapshot: None) -> None:
    """Delayed work (countdown, eta, retries with backoff) waits 'scheduled' and is promoted when
    due: the promoted rows' old versions stay in jobs_scheduled_idx as the claimed ones in
    jobs_claim_idx, and job_promote starts after them too."""
    after, measured = EARLIEST, {}
    for n in range(200):
        # 100 jobs that were scheduled and are due by now (a fabricated state: their countdown
        # ran out)
        pg.execute("INSERT INTO pgbroker.jobs (id, queue, body, state, run_at) "
                   "SELECT gen_random_uuid(), %s, '\\x', 'scheduled', clock_timestamp() "
                   "FROM generate_series(1, 100)", (QUEUE,))
        reached: list[datetime] = []
        assert store.promote([QUEUE], after=after, reached=reached) == 100
        after = reached[0]
        if n in (20, 199):  # what the next promotion reads to find that nothing is due
            measured[n] = (promote_buffers(pg, after), promote_buffers(pg, EARLIEST))
    (early, early_all), (late, late_all) = measured[20], measured[199]
    print(f"\npromotion buffers after 2,000 / 20,000 promoted: cursor {early} / {late}, "
          f"from the first {early_all} / {late_all}")
    assert late <= 1.25 * early + 10, measured
    assert late_all >= 4 * early_all and late_all >= 10 * late, measured


def test_a_scheduled_job_whose_transaction_commits_after_a_later_one_was_promoted_runs(
        loop: LoopConsumer, broker_url: str, db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url)
    with psycopg.connect(db_url) as late:
        try:
            started = late.execute("SELECT now()").fetchone()[0]  # its run_at's clock
            store.insert(new_job(QUEUE, "soon", run_at=db_now(pg) + timedelta(seconds=0.3)))
            loop.run_until(lambda: len(loop.received) == 1)  # promoted: the cursor is past it
            params = {**row_params(new_job(QUEUE, "late", run_at=started + timedelta(
                seconds=0.2))), "channel": Settings().channel}
            late.execute(queries("pgbroker")["job_insert"], params)
            late.commit()
            loop.run_until(lambda: len(loop.received) == 2)
        finally:
            store.close()
    assert [m.payload for m in loop.received] == ["soon", "late"]


#: The statements that settle or promote rows a claim or the sweeper chose: their parameters
#: for the running delivery (id, attempt) of a claimed job.
BY_ID: dict[str, Callable[[uuid.UUID, int], dict[str, Any]]] = {
    "job_ack": lambda id, attempt: {"ids": [id], "attempts": [attempt]},
    "job_ack_delete": lambda id, attempt: {"ids": [id], "attempts": [attempt]},
    "job_requeue": lambda id, attempt: {"ids": [id], "attempts": [attempt], "error": None,
                                        "channel": "pgbroker_cursor_test"},
    "job_bury": lambda id, attempt: {"id": id, "attempt": attempt, "error": "buried"},
    "job_promote": lambda id, attempt: {"queues": [QUEUE], "after": EARLIEST, "limit": 10,
                                        "channel": "pgbroker_cursor_test"},
}


def generic_plan_buffers(pg: psycopg.Connection, name: str, params: dict[str, Any]) -> int:
    """Shared buffers of ``name`` run once under its generic plan, the plan a connection that
    prepared it caches after five runs (PREPARE, plan_cache_mode, EXPLAIN EXECUTE; rolled
    back)."""
    text = queries("pgbroker")[name]
    order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
    positional = re.sub(r"%\((\w+)\)s", lambda m: f"${order.index(m[1]) + 1}", text)
    with pg.transaction(force_rollback=True):
        pg.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        pg.execute(f"PREPARE settle_probe AS {positional.replace('%%', '%')}", prepare=False)
        args = sql.SQL(", ").join(sql.Literal(params[key]) for key in order)
        plan = pg.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE "
                                  "settle_probe ({})").format(args)).fetchone()[0][0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


@pytest.mark.parametrize("name", list(BY_ID))
def test_settling_statements_read_their_rows_by_key_under_a_cached_plan(
        name: str, store: Store, pg: psycopg.Connection, held_snapshot: None) -> None:
    """Planned as a join with the rows it chose, job_ack's cached plan read the whole of
    jobs_live at every ack once four readers had kept its dead versions (2.9 ms and 3,296
    buffers an ack in the pressure benchmark, docs/benchmarks.md). Here 20,000 jobs went through
    jobs_live while a snapshot is held, and its statistics are fresh."""
    pg.execute("INSERT INTO pgbroker.jobs (id, queue, task, body, state) "
               "SELECT gen_random_uuid(), %s, 't.a', '\\x7b7d', 'pending' "
               "FROM generate_series(1, 20000)", (QUEUE,))
    pg.execute("UPDATE pgbroker.jobs SET state = 'completed' WHERE queue = %s "
               "AND state = 'pending'", (QUEUE,))
    pg.execute("ANALYZE pgbroker.jobs_live")
    pages = pg.execute("SELECT relpages FROM pg_class "
                       "WHERE oid = 'pgbroker.jobs_live'::regclass").fetchone()[0]
    consumer = uuid.uuid4()
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid) VALUES (%s, 'probe', 1)",
               (consumer,))
    store.insert(new_job(QUEUE, "settle me"))
    [row] = store.claim(QUEUE, 1, consumer)
    pg.execute("INSERT INTO pgbroker.jobs (id, queue, task, body, state, run_at) "
               "VALUES (gen_random_uuid(), %s, 't.a', '\\x7b7d', 'scheduled', now())", (QUEUE,))
    buffers = generic_plan_buffers(pg, name, BY_ID[name](row.id, row.attempt))
    assert pages > 100, pages
    assert buffers < 40, (name, buffers, pages)
