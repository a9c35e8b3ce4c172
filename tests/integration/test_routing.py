"""Exchanges, bindings, queue arguments and broadcasts through kombu (no Celery worker): what
Celery's remote control and events rely on, against a real, freshly migrated database per test.

Routing outcomes are read from the ``jobs``, ``queues``, ``bindings`` and ``broadcasts`` tables;
expiry is decided by the database clock (rows are aged with SQL instead of sleeping).
"""

from __future__ import annotations

import socket

from typing import Any

import kombu
import psycopg
import pytest

import pgbroker
from pgbroker._pg.store import Store
from pgbroker.sweeper import Sweeper
from tests.support.processes import wait_for
from tests.support.transport import (
    Collector,
    connect,
    counts,
    db_now,
    drain_until,
    jobs,
    store_for,
)

TRANSIENT = 1  # AMQP delivery_mode of Celery's replies and events


def routed(pg: psycopg.Connection) -> dict[str, list[str]]:
    """``{routing key: [queues its jobs went to]}`` over every job row."""
    return dict(pg.execute(
        "SELECT routing_key, array_agg(queue ORDER BY queue) FROM pgbroker.jobs"
        " GROUP BY routing_key").fetchall())


def table_count(pg: psycopg.Connection, table: str, where: str = "true",
                params: Any = None) -> int:
    row = pg.execute(f"SELECT count(*) FROM pgbroker.{table} WHERE {where}", params).fetchone()
    assert row is not None
    return int(row[0])


def age_queues(pg: psycopg.Connection, seconds: float, names: list[str] | None = None) -> None:
    """Make queues look unused for ``seconds`` (x-expires counts from ``last_used_at``)."""
    pg.execute("UPDATE pgbroker.queues SET last_used_at = now() - make_interval(secs => %s)"
               " WHERE %s::text[] IS NULL OR name = ANY(%s)", (seconds, names, names))


# -- topic -----------------------------------------------------------------------------------------

TOPIC_BINDINGS = {"q_star": "stock.*", "q_hash": "stock.#", "q_all": "#", "q_mid": "*.usd.*",
                  "q_exact": "stock.eur"}


def _bind_topic(conn: kombu.Connection, name: str) -> kombu.Exchange:
    exchange = kombu.Exchange(name, type="topic")
    for queue, key in TOPIC_BINDINGS.items():
        kombu.Queue(f"{name}_{queue}", exchange=exchange,
                    routing_key=key)(conn.default_channel).declare()
    return exchange


@pytest.mark.parametrize("same_connection", [True, False], ids=["local", "other-process"])
def test_topic_star_and_hash_route_like_amqp(broker_url: str, pg: psycopg.Connection,
                                             same_connection: bool) -> None:
    # local: the publisher declared the bindings itself (kombu's in-memory state answers);
    # other-process: it never saw them, so only the bindings table can route its messages.
    with connect(broker_url) as binder, connect(broker_url) as other:
        exchange = _bind_topic(binder, "tx")
        publisher = binder if same_connection else other
        producer = kombu.Producer(publisher.default_channel, exchange=exchange)
        for key in ("stock.eur", "stock.usd.nyse", "bond.usd.x", "bond.eur", "cash"):
            producer.publish({"key": key}, routing_key=key)

    q = {name: f"tx_{name}" for name in TOPIC_BINDINGS}
    assert routed(pg) == {
        # '*' is exactly one word; '#' any number of them; other words must be equal
        "stock.eur": sorted([q["q_star"], q["q_hash"], q["q_all"], q["q_exact"]]),
        "stock.usd.nyse": sorted([q["q_hash"], q["q_all"], q["q_mid"]]),
        "bond.usd.x": sorted([q["q_all"], q["q_mid"]]),
        "bond.eur": [q["q_all"]],
        "cash": [q["q_all"]],
        # ('#' matching zero words, 'stock' -> q_hash: see the next test)
    }


def test_topic_hash_matches_zero_words(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        exchange = kombu.Exchange("tz", type="topic")
        for queue, key in {"tz_tail": "stock.#", "tz_head": "#.eur", "tz_mid": "a.#.c"}.items():
            kombu.Queue(queue, exchange=exchange, routing_key=key)(conn.default_channel).declare()
        producer = kombu.Producer(conn.default_channel, exchange=exchange)
        for key in ("stock", "eur", "a.c"):
            producer.publish({"key": key}, routing_key=key)
    assert routed(pg) == {"stock": ["tz_tail"], "eur": ["tz_head"], "a.c": ["tz_mid"]}


# -- bindings across connections -------------------------------------------------------------------

def test_bindings_are_rows_every_connection_routes_by(broker_url: str,
                                                      pg: psycopg.Connection) -> None:
    exchange = kombu.Exchange("shared_fan", type="fanout")
    with connect(broker_url) as a:
        for name in ("sf1", "sf2"):
            kombu.Queue(name, exchange=exchange)(a.default_channel).declare()
        assert pg.execute("SELECT exchange, queue FROM pgbroker.bindings WHERE exchange = "
                          "'shared_fan' ORDER BY queue").fetchall() == [
            ("shared_fan", "sf1"), ("shared_fan", "sf2")]
        assert pg.execute("SELECT type FROM pgbroker.exchanges WHERE name = 'shared_fan'"
                          ).fetchone() == ("fanout",)
        a.default_channel.queue_unbind("sf2", exchange="shared_fan", routing_key="")
    assert table_count(pg, "bindings", "exchange = 'shared_fan'") == 1
    # a connection that never declared anything sees the exchange's type and what is left
    with connect(broker_url) as fresh:
        channel = fresh.default_channel
        assert channel.typeof("shared_fan").type == "fanout"
        assert channel._lookup("shared_fan", "") == ["sf1"]


def test_a_binding_made_after_a_publishers_lookup_routes_its_next_message(
        broker_url: str, pg: psycopg.Connection) -> None:
    exchange = kombu.Exchange("late_reply", type="direct")
    with connect(broker_url) as client, connect(broker_url) as worker:
        producer = kombu.Producer(worker.default_channel, exchange=exchange)
        producer.publish({"n": 1}, routing_key="ticket1")  # nobody bound yet: a dead letter
        assert counts(pg) == {"dead": 1}
        kombu.Queue("reply1", exchange=exchange, routing_key="ticket1")(
            client.default_channel).declare()
        producer.publish({"n": 2}, routing_key="ticket1")
    assert routed(pg) == {"ticket1": ["pgbroker.unroutable", "reply1"]}  # (the first: dead)


def test_a_deleted_queue_gets_no_message_from_a_publisher_that_saw_its_binding(
        broker_url: str, pg: psycopg.Connection) -> None:
    exchange = kombu.Exchange("stale_reply", type="direct")
    with connect(broker_url) as client, connect(broker_url) as worker:
        for key in ("t1", "t2"):  # two clients waiting for replies
            kombu.Queue(f"reply_{key}", exchange=exchange, routing_key=key)(
                client.default_channel).declare()
        producer = kombu.Producer(worker.default_channel, exchange=exchange)
        producer.publish({"n": 1}, routing_key="t1")  # the worker reads both bindings
        client.default_channel.queue_delete("reply_t2")  # the second client gave up
        producer.publish({"n": 2}, routing_key="t2", delivery_mode=1)  # its late reply
    assert routed(pg) == {"t1": ["reply_t1"]}  # dropped, as RabbitMQ drops a transient one


# -- fanout ----------------------------------------------------------------------------------------

def test_fanout_is_a_job_in_every_bound_queue_waiting_until_consumed(
        broker_url: str, pg: psycopg.Connection) -> None:
    # AMQP: a message to a fanout exchange goes into every bound queue and waits there
    exchange = kombu.Exchange("fan_kept", type="fanout")
    queues = [kombu.Queue(name, exchange=exchange) for name in ("fk1", "fk2")]
    with connect(broker_url) as declarer:
        for queue in queues:
            queue(declarer.default_channel).declare()
        kombu.Queue("fk1", exchange=exchange, routing_key="other")(  # bound twice: one job
            declarer.default_channel).declare()
    with connect(broker_url) as producer:  # knows nothing of the bindings but the table
        kombu.Producer(producer.default_channel, exchange=exchange).publish({"n": 1})
    assert sorted(r["queue"] for r in jobs(pg)) == ["fk1", "fk2"]
    assert len({r["id"] for r in jobs(pg)}) == 2
    assert table_count(pg, "broadcasts") == 0
    with connect(broker_url) as later:  # consumers that started after the publish
        for queue in queues:
            collector = Collector(later, [queue], ack=True)
            collector.take(1)
            assert collector.bodies == [{"n": 1}]
            assert collector.received[0][1].delivery_info["exchange"] == "fan_kept"
            collector.cancel()
    assert counts(pg) == {"completed": 2}


def test_a_fanout_inside_a_transaction_is_written_by_it(broker_url: str, db_url: str,
                                                       pg: psycopg.Connection) -> None:
    exchange = kombu.Exchange("fan_tx", type="fanout")
    with connect(broker_url) as conn:
        for name in ("ft1", "ft2"):
            kombu.Queue(name, exchange=exchange)(conn.default_channel).declare()
        with psycopg.connect(db_url) as caller:
            with pgbroker.transaction(caller):
                kombu.Producer(conn.default_channel, exchange=exchange).publish({"n": 1})
            assert counts(pg) == {}  # the caller has not committed yet
        assert sorted(r["queue"] for r in jobs(pg)) == ["ft1", "ft2"]


def test_fanout_to_auto_delete_queues_reaches_the_consumers_listening(
        broker_url: str, pg: psycopg.Connection) -> None:
    # Celery's mailboxes and Broadcast queues are auto-delete: in AMQP they exist while they are
    # consumed. They get a broadcast row (no job), read by every process consuming one of them;
    # a durable queue bound to the same exchange gets a job, and no copy of the broadcast.
    exchange = kombu.Exchange("fan", type="fanout")
    blob = "x" * 20_000  # far over pg_notify's 8000 bytes: the NOTIFY carries only the row id
    with connect(broker_url) as a, connect(broker_url) as b, connect(broker_url) as producer:
        queues = {name: kombu.Queue(name, exchange=exchange, auto_delete=True)
                  for name in ("fa1", "fa2", "fb1", "f_idle")}
        queues["f_kept"] = kombu.Queue("f_kept", exchange=exchange)
        collectors = {name: Collector(conn, [queues[name]], ack=True)
                      for conn, name in ((a, "fa1"), (a, "fa2"), (b, "fb1"), (b, "f_kept"))}
        queues["f_idle"](producer.default_channel).declare()  # bound, but nobody consumes it
        kombu.Producer(producer.default_channel, exchange=exchange).publish({"blob": blob})

        for conn, names in ((a, ("fa1", "fa2")), (b, ("fb1", "f_kept"))):
            drain_until(conn, lambda names=names: all(collectors[n].received for n in names),
                        what=f"the message in {names}")
        for collector in collectors.values():
            assert collector.nothing_for(0.3)  # exactly once per queue
            assert collector.bodies == [{"blob": blob}]
            assert collector.received[0][1].delivery_info["exchange"] == "fan"
        # one row for the auto-delete queues, one job for the durable one
        assert table_count(pg, "broadcasts") == 1
        assert [r["queue"] for r in jobs(pg)] == ["f_kept"]
        late = Collector(producer, [queues["f_idle"]], ack=True)
        assert late.nothing_for(0.5)


def test_fanout_with_nobody_bound_writes_nothing(broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        kombu.Producer(conn.default_channel,
                       exchange=kombu.Exchange("lonely", type="fanout")).publish({"n": 1})
    assert table_count(pg, "broadcasts") == 0
    assert counts(pg) == {}


def test_broadcasts_are_pruned_after_a_minute(broker_url: str, pg: psycopg.Connection,
                                              store: Store) -> None:
    exchange = kombu.Exchange("prune_fan", type="fanout")
    with connect(broker_url) as conn:
        kombu.Queue("prune_q", exchange=exchange, auto_delete=True)(conn.default_channel).declare()
        producer = kombu.Producer(conn.default_channel, exchange=exchange)
        producer.publish({"n": "old"})
        producer.publish({"n": "new"})
    assert table_count(pg, "broadcasts") == 2
    assert Sweeper(store).run_once().broadcasts == 0  # both are younger than a minute
    pg.execute("UPDATE pgbroker.broadcasts SET created_at = now() - interval '61 seconds'"
               " WHERE body = %s", (b'{"n": "old"}',))
    assert Sweeper(store).run_once().broadcasts == 1
    assert [bytes(r[0]) for r in pg.execute("SELECT body FROM pgbroker.broadcasts")] == \
        [b'{"n": "new"}']


# -- transient messages (worker events, replies) ---------------------------------------------------

def test_transient_topic_messages_never_reach_the_jobs_table(broker_url: str,
                                                             pg: psycopg.Connection) -> None:
    # Worker events: transient messages to a topic exchange, read by a no_ack consumer of a
    # queue bound with '#' (what celery's EventReceiver and Flower declare).
    exchange = kombu.Exchange("events_x", type="topic")
    with connect(broker_url) as monitor, connect(broker_url) as worker:
        queue = kombu.Queue("events_q", exchange=exchange, routing_key="#", auto_delete=True,
                            expires=60, message_ttl=5)
        collector = Collector(monitor, [queue], no_ack=True)
        producer = kombu.Producer(worker.default_channel, exchange=exchange)
        for n in range(50):
            producer.publish({"n": n}, routing_key="task.succeeded", delivery_mode=TRANSIENT)
        collector.take(50)
        assert sorted(b["n"] for b in collector.bodies) == list(range(50))
        assert counts(pg) == {}
        assert table_count(pg, "broadcasts", "exchange = 'events_x'") == 50
        # a persistent message to the same exchange is a job per bound queue, as ever
        producer.publish({"n": "durable"}, routing_key="task.succeeded")
        assert routed(pg) == {"task.succeeded": ["events_q"]}


def test_transient_replies_are_deleted_on_ack_and_no_ack_at_claim(
        broker_url: str, pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        producer = kombu.Producer(conn.default_channel)
        producer.publish({"r": "no_ack"}, routing_key="reply_na", delivery_mode=TRANSIENT)
        producer.publish({"r": "ack"}, routing_key="reply_ack", delivery_mode=TRANSIENT)
        producer.publish({"r": "durable"}, routing_key="reply_ack")
        assert counts(pg) == {"pending": 3}

        Collector(conn, ["reply_na"], no_ack=True).take(1)
        assert jobs(pg, "queue = 'reply_na'") == []  # gone at claim: nobody will ack it

        collector = Collector(conn, ["reply_ack"])
        collector.take(2)
        assert counts(pg) == {"running": 2}
        for _, message in collector.received:
            message.ack()
        # the transient row is deleted; the durable one is kept for the retention window
        assert [r["body"] for r in jobs(pg)] == [b'{"r": "durable"}']
        assert counts(pg) == {"completed": 1}


def test_one_drain_events_call_delivers_a_claim_and_the_next_calls_count_it(
        broker_url: str, pg: psycopg.Connection) -> None:
    # Everything one claim returned is delivered by one call, highest priority first.
    # kombu.pidbox.Mailbox._collect(limit=N) counts replies by drain_events calls: with two
    # replies delivered by its first call, its second call must not wait its timeout for a
    # third. It returns at once, delivering nothing; the one after waits again.
    with connect(broker_url) as conn:
        producer = kombu.Producer(conn.default_channel)
        for n in range(3):
            producer.publish({"reply": n}, routing_key="replies", delivery_mode=TRANSIENT,
                             priority=n % 2)
        collector = Collector(conn, ["replies"], no_ack=True)
        conn.drain_events(timeout=10)
        assert collector.bodies == [{"reply": 1}, {"reply": 0}, {"reply": 2}]
        conn.drain_events(timeout=60)  # (would raise socket.timeout after a minute)
        conn.drain_events(timeout=60)
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.2)
        assert len(collector.bodies) == 3
        # a cancelled consumer (the end of a Mailbox call) starts the count again
        producer.publish({"reply": 3}, routing_key="replies", delivery_mode=TRANSIENT)
        producer.publish({"reply": 4}, routing_key="replies", delivery_mode=TRANSIENT)
        conn.drain_events(timeout=10)
        assert len(collector.bodies) == 5
        collector.cancel()
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.2)


# -- queue arguments -------------------------------------------------------------------------------

def test_x_expires_deletes_idle_queues_with_their_bindings_and_messages(
        broker_url: str, pg: psycopg.Connection, store: Store) -> None:
    exchange = kombu.Exchange("exp_x", type="direct")
    with connect(broker_url) as conn, connect(broker_url) as other:
        declared = {name: kombu.Queue(name, exchange=exchange, routing_key=name, **kwargs)
                    for name, kwargs in {"idle_q": {"expires": 1}, "busy_q": {"expires": 1},
                                         "plain_q": {}}.items()}
        for queue in declared.values():
            queue(conn.default_channel).declare()
        assert pg.execute("SELECT arguments FROM pgbroker.queues WHERE name = 'idle_q'"
                          ).fetchone() == ({"x-expires": 1000},)
        producer = kombu.Producer(conn.default_channel, exchange=exchange)
        for name in ("idle_q", "idle_q", "plain_q"):
            producer.publish({"to": name}, routing_key=name)
        # a dead letter of the idle queue outlives it: nothing is silently dropped
        producer.publish({"to": "idle_q", "dead": True}, routing_key="idle_q")
        other.default_channel.basic_get("idle_q").reject(requeue=False)
        Collector(conn, [declared["busy_q"]])  # a consumed queue is in use, however idle

        assert Sweeper(store).run_once().queues == 0  # declared a moment ago: not idle yet
        age_queues(pg, 3600)
        assert Sweeper(store).run_once().queues == 1

        assert sorted(r[0] for r in pg.execute("SELECT name FROM pgbroker.queues")) == \
            ["busy_q", "plain_q"]
        assert table_count(pg, "bindings", "queue = 'idle_q'") == 0
        assert table_count(pg, "bindings", "exchange = 'exp_x'") == 2
        assert [(r["queue"], r["state"]) for r in jobs(pg, "queue = 'idle_q'")] == \
            [("idle_q", "dead")]
        assert [r["state"] for r in jobs(pg, "queue = 'plain_q'")] == ["pending"]


def test_a_queue_consumed_after_registration_is_never_expired(
        broker_url: str, pg: psycopg.Connection, store: Store) -> None:
    with connect(broker_url) as conn:
        Collector(conn, [kombu.Queue("first_q")])  # registers the consumer
        Collector(conn, [kombu.Queue("added_q", expires=1)])  # like celery's add_consumer
        age_queues(pg, 3600)
        Sweeper(store).run_once()
        assert table_count(pg, "queues", "name = 'added_q'") == 1


def test_x_message_ttl_and_expiration_are_never_delivered_and_are_cleaned_up(
        broker_url: str, pg: psycopg.Connection, db_url: str) -> None:
    exchange = kombu.Exchange("ttl_x", type="topic")
    ttl_queue = kombu.Queue("ttl_q", exchange=exchange, routing_key="ttl.#", message_ttl=0.3)
    plain = kombu.Queue("exp_q", exchange=exchange, routing_key="exp.#")
    with connect(broker_url) as conn:
        for queue in (ttl_queue, plain):
            queue(conn.default_channel).declare()
        producer = kombu.Producer(conn.default_channel, exchange=exchange)
        producer.publish({"n": "queue ttl"}, routing_key="ttl.a")          # x-message-ttl
        producer.publish({"n": "own ttl"}, routing_key="exp.a", expiration=0.3)
        producer.publish({"n": "forever"}, routing_key="exp.b")
        assert table_count(pg, "jobs", "expires_at IS NULL") == 1
        deadline = max(r["expires_at"] for r in jobs(pg, "expires_at IS NOT NULL"))
        wait_for(lambda: db_now(pg) > deadline, timeout=30, message="the messages to expire")

        collector = Collector(conn, [ttl_queue, plain], ack=True)
        collector.take(1)
        assert collector.nothing_for(0.5)
        assert collector.bodies == [{"n": "forever"}]

    sweeper_store = store_for(db_url, retention=0)
    try:
        result = Sweeper(sweeper_store).run_once()
    finally:
        sweeper_store.close()
    assert result.expired == 2
    assert counts(pg) == {}  # expired and completed rows pruned (retention 0)

