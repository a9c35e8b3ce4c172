"""kombu conformance: the generic behaviour every kombu transport shows, in the style of kombu's
own ``t/integration/common.py`` (BasicFunctionality, BaseExchangeTypes, BaseTimeToLive,
BasePriority), run against pgbroker on a fresh database per test.

Where kombu's suite sleeps (TTL, priority) these tests wait on the database clock instead, and
where pgbroker documents a difference from AMQP the test says so.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import closing
from datetime import timedelta
from typing import Any

import kombu
import pytest
from kombu.exceptions import ChannelError

from tests.support.processes import wait_for
from tests.support.transport import (
    NO_POLL,
    OPTIONS,
    Collector,
    connect,
    db_now,
    drain_until,
    free_port,
    jobs,
)


@pytest.fixture
def connection(broker_url: str) -> Iterator[kombu.Connection]:
    # Like a kombu user expects of any broker: no reliance on a poll to see a message.
    conn = connect(broker_url, **NO_POLL)
    try:
        yield conn
    finally:
        conn.release()


@pytest.fixture
def invalid_connection() -> Iterator[kombu.Connection]:
    conn = kombu.Connection(f"pgbroker://postgres@127.0.0.1:{free_port()}/nowhere",
                            transport_options={**OPTIONS, "max_retries": 1,
                                               "interval_start": 0, "interval_step": 0})
    try:
        yield conn
    finally:
        conn.release()


def consume_one(conn: kombu.Connection, queue: kombu.Queue, timeout: float = 1.0) -> list[Any]:
    """kombu's ``_consume``: one drain on a consumer of ``queue``; returns the bodies received
    (acked)."""
    bodies: list[Any] = []

    def callback(body: Any, message: kombu.Message) -> None:
        bodies.append(body)
        message.ack()

    with kombu.Consumer(conn, [queue], accept=["pickle", "json"], callbacks=[callback]):
        conn.drain_events(timeout=timeout)
    return bodies


def assert_nothing_delivered(conn: kombu.Connection, queue: kombu.Queue) -> None:
    """kombu's check: a consumer of ``queue`` receives nothing within a second."""
    def callback(body: Any, message: kombu.Message) -> None:
        raise AssertionError("Callback should not be called")

    consumer = kombu.Consumer(conn, [queue], accept=["pickle", "json"])
    consumer.register_callback(callback)
    with consumer:
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=1)


class TestBasicFunctionality:
    def test_connect(self, connection: kombu.Connection) -> None:
        assert connection.connect()
        assert connection.connection
        connection.close()
        assert connection.connection is None
        assert connection.connect()
        assert connection.connection
        connection.close()

    def test_failed_connect(self, invalid_connection: kombu.Connection) -> None:
        with pytest.raises(Exception):  # noqa: B017 - kombu's own test is this loose
            invalid_connection.connect()

    def test_failed_connect_raises_a_connection_error(
            self, invalid_connection: kombu.Connection) -> None:
        with pytest.raises(invalid_connection.connection_errors):
            invalid_connection.connect()

    def test_failed_connection(self, invalid_connection: kombu.Connection) -> None:
        with pytest.raises(Exception):  # noqa: B017
            invalid_connection.connection  # noqa: B018

    def test_failed_channel(self, invalid_connection: kombu.Connection) -> None:
        with pytest.raises(Exception):  # noqa: B017
            invalid_connection.channel()

    def test_failed_default_channel(self, invalid_connection: kombu.Connection) -> None:
        with pytest.raises(Exception):  # noqa: B017
            invalid_connection.default_channel  # noqa: B018

    def test_default_channel_autoconnect(self, connection: kombu.Connection) -> None:
        connection.connect()
        connection.close()
        assert connection.connection is None
        assert connection.default_channel
        assert connection.connection
        connection.close()

    def test_channel(self, connection: kombu.Connection) -> None:
        assert connection.channel()
        assert connection.connection

    def test_default_channel(self, connection: kombu.Connection) -> None:
        assert connection.default_channel
        assert connection.connection

    def test_publish_consume(self, connection: kombu.Connection) -> None:
        test_queue = kombu.Queue("test", routing_key="test")
        received = []

        def callback(body: Any, message: kombu.Message) -> None:
            assert body == {"hello": "world"}
            assert message.content_type == "application/x-python-serialize"
            assert message.delivery_info["routing_key"] == "test"
            assert message.delivery_info["exchange"] == ""  # Queue() uses the default exchange
            message.ack()
            assert message.payload == body
            received.append(body)

        with connection as conn:
            with conn.channel() as channel:
                producer = kombu.Producer(channel)
                producer.publish({"hello": "world"}, retry=True, exchange=test_queue.exchange,
                                 routing_key=test_queue.routing_key, declare=[test_queue],
                                 serializer="pickle")
                consumer = kombu.Consumer(conn, [test_queue], accept=["pickle"])
                consumer.register_callback(callback)
                with consumer:
                    conn.drain_events(timeout=1)
        assert received == [{"hello": "world"}]

    def test_consume_empty_queue(self, connection: kombu.Connection) -> None:
        with connection as conn:
            assert_nothing_delivered(conn, kombu.Queue("test_empty", routing_key="test_empty"))

    @pytest.mark.parametrize("kind", ["SimpleQueue", "SimpleBuffer"])
    def test_simple_publish_consume(self, connection: kombu.Connection, kind: str) -> None:
        with connection as conn:
            with closing(getattr(conn, kind)(f"{kind}_test")) as queue:
                queue.put({"Hello": "World"}, headers={"k1": "v1"})
                message = queue.get(timeout=1)
                assert message.payload == {"Hello": "World"}
                assert message.content_type == "application/json"
                assert message.content_encoding == "utf-8"
                assert message.headers == {"k1": "v1"}
                message.ack()
                with pytest.raises(queue.Empty):
                    queue.get(timeout=0.2)

    def test_message_properties_round_trip(self, connection: kombu.Connection) -> None:
        with connection as conn, closing(conn.SimpleQueue("props")) as queue:
            queue.put(b"\x00\xffbinary", content_type="application/octet-stream",
                      content_encoding="binary", correlation_id="corr-1", reply_to="replies",
                      headers={"nested": {"a": [1, 2]}, "unicode": "é"})
            message = queue.get(timeout=1)
            assert message.body == b"\x00\xffbinary"
            assert message.content_type == "application/octet-stream"
            assert message.properties["correlation_id"] == "corr-1"
            assert message.properties["reply_to"] == "replies"
            assert message.headers == {"nested": {"a": [1, 2]}, "unicode": "é"}
            message.ack()


class TestQueueOperations:
    def test_queue_declare_reports_the_message_count(self, connection: kombu.Connection) -> None:
        with connection as conn:
            queue = kombu.Queue("count_test")(conn.default_channel)
            assert queue.declare() == "count_test"
            name, count, _ = queue.queue_declare(passive=True)
            assert (name, count) == ("count_test", 0)
            producer = kombu.Producer(conn.default_channel)
            for n in range(4):
                producer.publish({"n": n}, routing_key="count_test")
            assert queue.queue_declare(passive=True).message_count == 4

    def test_passive_declare_of_a_missing_queue_is_a_channel_error(
            self, connection: kombu.Connection) -> None:
        with connection as conn:
            with pytest.raises(ChannelError):
                conn.default_channel.queue_declare("never_declared", passive=True)

    def test_purge(self, connection: kombu.Connection) -> None:
        with connection as conn, closing(conn.SimpleQueue("purge_test")) as queue:
            for n in range(3):
                queue.put({"n": n})
            assert queue.qsize() == len(queue) == 3
            assert queue.clear() == 3
            assert queue.qsize() == 0
            with pytest.raises(queue.Empty):
                queue.get_nowait()
    def test_queue_delete(self, connection: kombu.Connection) -> None:
        with connection as conn:
            queue = kombu.Queue("delete_test")(conn.default_channel)
            queue.declare()
            kombu.Producer(conn.default_channel).publish({"n": 1}, routing_key="delete_test")
            queue.delete()
            with pytest.raises(ChannelError):
                conn.default_channel.queue_declare("delete_test", passive=True)

    def test_queue_delete_of_a_queue_bound_to_a_named_exchange(
            self, connection: kombu.Connection) -> None:
        ex = kombu.Exchange("delete_ex", type="direct")
        with connection as conn:
            queue = kombu.Queue("delete_bound", exchange=ex, routing_key="k")(conn.default_channel)
            queue.declare()
            kombu.Producer(conn.default_channel, exchange=ex).publish({"n": 1}, routing_key="k")
            queue.delete()
            with pytest.raises(ChannelError):
                conn.default_channel.queue_declare("delete_bound", passive=True)

    def test_consume_from_several_queues(self, connection: kombu.Connection) -> None:
        queues = [kombu.Queue(f"multi{n}") for n in range(3)]
        with connection as conn:
            producer = kombu.Producer(conn.default_channel)
            for queue, count in zip(queues, (2, 1, 3)):
                for n in range(count):
                    producer.publish({"q": queue.name, "n": n}, routing_key=queue.name,
                                     declare=[queue])
            collector = Collector(conn, queues, ack=True)
            collector.take(6)
            assert collector.nothing_for(0.3)
        assert sorted((b["q"], b["n"]) for b in collector.bodies) == [
            ("multi0", 0), ("multi0", 1), ("multi1", 0), ("multi2", 0), ("multi2", 1),
            ("multi2", 2)]

    def test_requeue_redelivers_with_the_redelivered_flag(
            self, connection: kombu.Connection) -> None:
        with connection as conn, closing(conn.SimpleQueue("requeue_test")) as queue:
            queue.put({"n": 1})
            first = queue.get(timeout=1)
            assert first.delivery_info["redelivered"] is False
            first.requeue()
            second = queue.get(timeout=1)
            assert second.payload == {"n": 1}
            assert second.delivery_info["redelivered"] is True
            second.ack()

    def test_cancelled_consumer_receives_nothing_more(self, connection: kombu.Connection) -> None:
        with connection as conn:
            collector = Collector(conn, ["cancel_test"], ack=True)
            kombu.Producer(conn.default_channel).publish({"n": 1}, routing_key="cancel_test")
            collector.take(1)
            collector.cancel()
            kombu.Producer(conn.default_channel).publish({"n": 2}, routing_key="cancel_test")
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.3)
            assert conn.default_channel.queue_declare("cancel_test", passive=True) \
                .message_count == 1

    @pytest.mark.parametrize("how", ["basic_get", "consumer"])
    def test_no_ack_messages_are_gone_once_delivered(self, broker_url: str, how: str) -> None:
        with connect(broker_url) as conn:
            kombu.Producer(conn.default_channel).publish({"n": 1}, routing_key="no_ack_test")
            if how == "basic_get":
                message = conn.default_channel.basic_get("no_ack_test", no_ack=True)
                assert message is not None and message.payload == {"n": 1}
            else:
                assert Collector(conn, ["no_ack_test"], no_ack=True).take(1)
        with connect(broker_url) as conn:  # nothing comes back after the consumer left
            with closing(conn.SimpleQueue("no_ack_test")) as queue:
                with pytest.raises(queue.Empty):
                    queue.get(timeout=0.5)


class TestExchangeTypes:
    def _publish(self, channel: Any, exchange: kombu.Exchange, queues: list[kombu.Queue],
                 routing_key: str | None = None) -> None:
        producer = kombu.Producer(channel, exchange=exchange)
        extra = {"routing_key": routing_key} if routing_key else {}
        producer.publish({"hello": "world"}, declare=list(queues), serializer="pickle", **extra)

    def test_direct(self, connection: kombu.Connection) -> None:
        ex = kombu.Exchange("test_direct", type="direct")
        test_queue = kombu.Queue("direct1", exchange=ex)
        with connection as conn, conn.channel() as channel:
            self._publish(channel, ex, [test_queue])
            assert consume_one(conn, test_queue) == [{"hello": "world"}]

    def test_direct_routing_keys(self, connection: kombu.Connection) -> None:
        ex = kombu.Exchange("test_rk_direct", type="direct")
        test_queue1 = kombu.Queue("rk_direct1", exchange=ex, routing_key="d1")
        test_queue2 = kombu.Queue("rk_direct2", exchange=ex, routing_key="d2")
        with connection as conn, conn.channel() as channel:
            self._publish(channel, ex, [test_queue1, test_queue2], "d1")
            assert consume_one(conn, test_queue1) == [{"hello": "world"}]
            assert_nothing_delivered(conn, test_queue2)  # direct2 queue should not have data

    def test_topic(self, connection: kombu.Connection) -> None:
        ex = kombu.Exchange("test_topic", type="topic")
        test_queue1 = kombu.Queue("topic1", exchange=ex, routing_key="t.*")
        test_queue2 = kombu.Queue("topic2", exchange=ex, routing_key="t.*")
        test_queue3 = kombu.Queue("topic3", exchange=ex, routing_key="t")
        with connection as conn, conn.channel() as channel:
            self._publish(channel, ex, [test_queue1, test_queue2, test_queue3], "t.1")
            assert consume_one(conn, test_queue1) == [{"hello": "world"}]
            assert consume_one(conn, test_queue2) == [{"hello": "world"}]
            assert_nothing_delivered(conn, test_queue3)  # topic3 queue should not have data

    def test_bindings_declared_by_another_connection_route_messages(self, broker_url: str,
                                                                     pg: Any) -> None:
        # AMQP keeps bindings in the broker: a producer that never declared the queue still
        # routes to it. (kombu's virtual transports keep them in process memory.)
        ex = kombu.Exchange("shared_direct", type="direct")
        queue = kombu.Queue("bound_elsewhere", exchange=ex, routing_key="rk")
        with connect(broker_url) as consumer_side, connect(broker_url) as producer_side:
            queue(consumer_side.default_channel).declare()
            kombu.Producer(producer_side.default_channel, exchange=ex).publish(
                {"n": 1}, routing_key="rk")
            assert [r["queue"] for r in jobs(pg)] == ["bound_elsewhere"]
            assert consume_one(consumer_side, queue) == [{"n": 1}]

    def test_fanout_reaches_every_bound_queue_consumed_or_not(self, broker_url: str) -> None:
        # as in AMQP: the message waits in each bound queue (auto-delete queues, which exist
        # only while consumed, get a broadcast instead: tests/integration/test_routing.py)
        ex = kombu.Exchange("test_fanout", type="fanout")
        queues = [kombu.Queue("fanout1", exchange=ex), kombu.Queue("fanout2", exchange=ex)]
        with connect(broker_url) as producer:
            kombu.Producer(producer.default_channel, exchange=ex).publish(
                {"hello": "world"}, declare=queues)
        with connect(broker_url) as a, connect(broker_url) as b:
            collectors = [Collector(a, [queues[0]], ack=True), Collector(b, [queues[1]], ack=True)]
            for collector in collectors:
                collector.take(1)
                assert collector.nothing_for(0.2)
                assert collector.bodies == [{"hello": "world"}]

    def test_fanout_reaches_a_consumer_that_has_not_drained_yet(self, broker_url: str) -> None:
        ex = kombu.Exchange("test_fanout_early", type="fanout")
        queue = kombu.Queue("fanout_early", exchange=ex)
        with connect(broker_url, **NO_POLL) as consumer_side, connect(broker_url) as producer:
            collector = Collector(consumer_side, [queue], ack=True)
            kombu.Producer(producer.default_channel, exchange=ex).publish(
                {"hello": "world"}, declare=[queue])
            collector.take(1, timeout=5)

    def test_transport_declares_its_exchange_types(self, connection: kombu.Connection) -> None:
        for kind in ("direct", "topic", "fanout"):
            assert connection.supports_exchange_type(kind)
        assert not connection.supports_exchange_type("headers")


class TestTimeToLive:
    def _expire(self, conn: kombu.Connection, pg: Any, queue_name: str) -> None:
        """Wait (database clock) until every message of ``queue_name`` is past its expiry."""
        [row] = jobs(pg, "queue = %s", (queue_name,))
        wait_for(lambda: db_now(pg) > row["expires_at"], timeout=30)

    def test_publish_consume(self, connection: kombu.Connection, pg: Any) -> None:
        test_queue = kombu.Queue("ttl_test", routing_key="ttl_test")
        with connection as conn, conn.channel() as channel:
            kombu.Producer(channel).publish(
                {"hello": "world"}, retry=True, exchange=test_queue.exchange,
                routing_key=test_queue.routing_key, declare=[test_queue], serializer="pickle",
                expiration=0.2)
            self._expire(conn, pg, "ttl_test")
            assert_nothing_delivered(conn, test_queue)

    @pytest.mark.parametrize("kind", ["SimpleQueue", "SimpleBuffer"])
    def test_simple_publish_consume(self, connection: kombu.Connection, pg: Any,
                                    kind: str) -> None:
        with connection as conn, closing(getattr(conn, kind)(f"ttl_{kind}")) as queue:
            queue.put({"Hello": "World"}, headers={"k1": "v1"}, expiration=0.2)
            self._expire(conn, pg, f"ttl_{kind}")
            with pytest.raises(queue.Empty):
                queue.get(timeout=1)

    def test_queue_message_ttl(self, connection: kombu.Connection, pg: Any) -> None:
        """A queue declared with ``message_ttl`` (x-message-ttl) expires what it holds."""
        queue = kombu.Queue("ttl_queue", message_ttl=0.2)
        with connection as conn:
            kombu.Producer(conn.default_channel).publish({"n": 1}, routing_key="ttl_queue",
                                                         declare=[queue])
            self._expire(conn, pg, "ttl_queue")
            assert_nothing_delivered(conn, queue)

    def test_unexpired_messages_are_delivered(self, connection: kombu.Connection) -> None:
        with connection as conn, closing(conn.SimpleQueue("ttl_alive")) as queue:
            queue.put({"n": 1}, expiration=600)
            message = queue.get(timeout=1)
            assert message.payload == {"n": 1}
            message.ack()


class TestPriority:
    """AMQP direction: higher numbers run first (kombu's ``PRIORITY_ORDER = 'asc'``)."""

    def test_publish_consume(self, connection: kombu.Connection) -> None:
        test_queue = kombu.Queue("priority_test", routing_key="priority_test", max_priority=10)
        received: list[Any] = []

        def callback(body: Any, message: kombu.Message) -> None:
            received.append(body)
            message.ack()

        with connection as conn, conn.channel() as channel:
            producer = kombu.Producer(channel)
            for msg, prio in [({"msg": "first"}, 3), ({"msg": "second"}, 6),
                              ({"msg": "third"}, 3)]:
                producer.publish(msg, retry=True, exchange=test_queue.exchange,
                                 routing_key=test_queue.routing_key, declare=[test_queue],
                                 serializer="pickle", priority=prio)
            consumer = kombu.Consumer(conn, [test_queue], accept=["pickle"])
            consumer.register_callback(callback)
            with consumer:
                drain_until(conn, lambda: len(received) == 3, timeout=10)
        assert received == [{"msg": "second"}, {"msg": "first"}, {"msg": "third"}]

    @pytest.mark.parametrize("kind", ["SimpleQueue", "SimpleBuffer"])
    def test_simple_publish_consume(self, connection: kombu.Connection, kind: str) -> None:
        with connection as conn:
            with closing(getattr(conn, kind)(f"priority_{kind}",
                                             queue_opts={"max_priority": 10})) as queue:
                for msg, prio in [({"msg": "first"}, 1), ({"msg": "second"}, 7),
                                  ({"msg": "third"}, 1)]:
                    queue.put(msg, headers={"k1": "v1"}, priority=prio)
                for data in [{"msg": "second"}, {"msg": "first"}, {"msg": "third"}]:
                    msg = queue.get(timeout=1)
                    msg.ack()
                    assert msg.payload == data


def test_delayed_delivery_is_not_handed_out_early(connection: kombu.Connection, pg: Any) -> None:
    """Not in kombu's suite (AMQP has no eta): Celery's ``eta`` header waits in the database."""
    with connection as conn, closing(conn.SimpleQueue("eta_test")) as queue:
        eta = db_now(pg) + timedelta(seconds=1)
        queue.put({"n": 1}, headers={"eta": eta.isoformat()})
        message = queue.get(timeout=30)
        [row] = jobs(pg)
        assert row["locked_at"] >= eta
        message.ack()
