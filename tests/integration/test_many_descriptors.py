"""A process with more than 1,024 open descriptors (a busy web server, a gevent worker): its
broker sockets are numbered above 1023, where ``select()`` fails (FD_SETSIZE); pgbroker waits
on them with ``poll()``."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import kombu
import psycopg
import pytest

from tests.support.transport import LoopConsumer, NO_POLL, connect, drain_until, \
    publish


@pytest.fixture
def high_descriptors() -> Iterator[None]:
    """The descriptors below 1100 taken, so every socket opened meanwhile is numbered above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    taken = []
    fd = os.open(os.devnull, os.O_RDONLY)
    while fd < 1100:
        taken.append(fd)
        fd = os.dup(fd)
    taken.append(fd)
    try:
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_publish_and_drain_on_sockets_above_1023(high_descriptors: None, broker_url: str,
                                                  pg: psycopg.Connection) -> None:
    received: list[object] = []
    with connect(broker_url) as conn:
        publish(conn, "high", "fds")  # the store's prepared insert waits for its PREPARE
        assert conn.transport.store.conn.pgconn.socket > 1023
        queue = kombu.Queue("fds")
        with kombu.Consumer(conn.default_channel, [queue], accept=["json"],
                            callbacks=[lambda body, m: (received.append(body), m.ack())]):
            drain_until(conn, lambda: received)
    assert received == ["high"]


def test_the_event_loop_on_sockets_above_1023(high_descriptors: None, broker_url: str,
                                              pg: psycopg.Connection) -> None:
    with connect(broker_url) as conn:
        publish(conn, "looped", "fds-loop")
    with connect(broker_url, **NO_POLL) as conn:
        consumer = LoopConsumer(conn, "fds-loop", prefetch=4)  # prepares its statements
        assert conn.transport.consumer.listen().pgconn.socket > 1023
        consumer.run_until(lambda: len(consumer.received) == 1)
        consumer.hub.close()
    assert consumer.received[0].payload == "looped"
