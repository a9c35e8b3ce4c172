"""The claim's gate (issue 22, cost): a queue is claimed by ``job_claim`` (main's cheap
statement) until it is gated -- it has held a job with a concurrency key, or a rate limit exists
-- and by ``job_claim_gated`` from then on. ``job_claim`` never takes a job of a gated queue: it
returns a marker row, and the claim is made again by ``job_claim_gated`` at once, so a keyed job
arriving in a queue consumed so far by the cheap statement never waits (both consuming paths).
"""

from __future__ import annotations

import uuid

import psycopg

from pgbroker._model.claimed import after_params
from pgbroker._pg.catalogue import queries
from pgbroker._pg.store import Store
from tests.support.transport import (
    NO_POLL,
    Collector,
    LoopConsumer,
    connect,
    counts,
    new_job,
    publish,
)


def gated(pg: psycopg.Connection) -> set[str]:
    return {r[0] for r in pg.execute("SELECT name FROM pgbroker.gated_queues")}


def plain_claim(pg: psycopg.Connection, queue: str,
                acks: list[tuple[uuid.UUID, int]] = ()) -> list[tuple]:  # type: ignore[assignment]
    return pg.execute(queries("pgbroker")["job_claim"],
                      {"queue": queue, "limit": 10, "consumer": uuid.uuid4(),
                       "ids": [a for a, _ in acks], "attempts": [n for _, n in acks],
                       **after_params()}).fetchall()


def test_a_keyed_job_gates_its_queue_and_job_claim_yields_only_the_marker(
        store: Store, pg: psycopg.Connection) -> None:
    store.insert_many([new_job("q", task="t"), new_job("other", task="t")])
    [row] = plain_claim(pg, "q")  # ungated: main's claim, no marker
    assert row[0] is not None and gated(pg) == set()
    store.insert_many([new_job("q", task="t", headers={"concurrency_key": "k"}),
                       new_job("q", task="t")])
    assert gated(pg) == {"q"}  # in the insert's transaction
    # job_claim takes nothing of a gated queue, keyed or not, but makes its acks
    assert [r[0] for r in plain_claim(pg, "q", [(row[0], row[2])])] == [None]
    assert counts(pg) == {"completed": 1, "pending": 3}
    assert len(plain_claim(pg, "other")) == 1  # another queue is not gated
    # Store.claim makes the claim again by job_claim_gated: both jobs, and says so
    rows = store.claim("q", 10, uuid.uuid4())
    assert len(rows) == 2 and rows.gated


def test_a_rate_limit_gates_every_queue_while_it_exists(store: Store,
                                                         pg: psycopg.Connection) -> None:
    store.insert_many([new_job("q", task="t")])
    pg.execute("INSERT INTO pgbroker.rate_limits (task, max_starts, period_s, rate)"
               " VALUES ('elsewhere', 1, 1, '1/s')")
    assert gated(pg) == {""}
    assert [r[0] for r in plain_claim(pg, "q")] == [None]
    pg.execute("DELETE FROM pgbroker.rate_limits")
    assert gated(pg) == set()
    assert len(plain_claim(pg, "q")) == 1


def test_event_loop_a_keyed_job_in_a_queue_not_known_gated_is_claimed_at_once(
        broker_url: str, pg: psycopg.Connection) -> None:
    # (published first: with no poll, main's loop can miss a NOTIFY that arrives just after a
    # claim, about 1 run in 4 -- another matter, see the report of branch i22c)
    with connect(broker_url) as producer:
        publish(producer, 0, "g")
        publish(producer, 1, "g", headers={"concurrency_key": "k"})
    with connect(broker_url, **NO_POLL) as conn:  # no poll: only the NOTIFYs and the claims
        consumer = LoopConsumer(conn, "g", prefetch=4)
        policy = consumer.consumer.channel.claims
        assert not policy.gated("g")  # its first claim is job_claim's: the marker, then ...
        consumer.run_until(lambda: len(consumer.received) == 2, timeout=10)
        assert policy.gated("g")  # ... job_claim_gated's, and so from now on
        consumer.run_until(lambda: counts(pg).get("completed") == 2)
        consumer.hub.close()
    assert sorted(m.payload for m in consumer.received) == [0, 1]


def test_drain_events_a_keyed_job_after_unkeyed_ones_is_claimed_at_once(
        broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url, **NO_POLL) as conn, connect(broker_url) as producer:
        collector = Collector(conn, ["g"], ack=True, prefetch_count=4)
        publish(producer, 0, "g")
        collector.take(1, timeout=10)
        publish(producer, 1, "g", headers={"concurrency_key": "k"})
        publish(producer, 2, "g")
        assert sorted(collector.bodies[1:] + [b for b, _ in collector.take(2, timeout=10)]) \
            == [1, 2]
    assert gated(pg) == {"g"}
