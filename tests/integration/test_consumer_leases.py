"""Each consumer is judged by its own lease (issue 27, item 4; 0016_consumer_lease.sql).

Consumers registered with leases of 20 s and 60 s, and a row of a pgbroker before 0016 (no lease
of its own), judged by sweepers, health, metrics and the admin page configured with 20 s or 60 s:
the judge's setting counts for the row without a lease only. Fabricated rows and
``Sweeper.run_once(now=...)``: no waiting for a lease to run out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from flask.testing import FlaskClient

from pgbroker import health
from pgbroker._pg.store import Store
from pgbroker.metrics import MetricsReader
from pgbroker.sweeper import Sweeper
from tests.support.transport import age_consumer, new_job, store_for
from tests.support.db import db_now, jobs


@pytest.fixture
def stores(db_url: str) -> Iterator[dict[int, Store]]:
    """Stores of workers configured with a lease of 20 s and of 60 s."""
    made = {lease: store_for(db_url, lease_timeout=lease, heartbeat_interval=5)
            for lease in (20, 60)}
    yield made
    for store in made.values():
        store.close()


def register(stores: dict[int, Store], pg: psycopg.Connection) -> dict[str, uuid.UUID]:
    """Consumers of queues 'short' (20 s), 'long' (60 s) and 'older' (registered with 20 s,
    then its lease taken away, as a pgbroker before 0016 leaves its row), each running a job."""
    owners = {}
    for name, store in (("short", stores[20]), ("long", stores[60]), ("older", stores[20])):
        owners[name] = consumer = uuid.uuid4()
        store.register_consumer(consumer, [name], None)
        store.insert_many([new_job(name, {"n": 1})])
        assert len(store.claim(name, 1, consumer)) == 1
    pg.execute("UPDATE pgbroker.consumers SET lease_timeout = NULL WHERE id = %s",
               (owners["older"],))
    assert dict(pg.execute("SELECT queues[1], lease_timeout FROM pgbroker.consumers")
                .fetchall()) == {"short": 20, "long": 60, "older": None}
    return owners


def test_each_consumer_is_rescued_by_its_own_lease(stores: dict[int, Store],
                                                    pg: psycopg.Connection) -> None:
    register(stores, pg)
    now = db_now(pg)

    def running() -> list[str]:
        return sorted(r["queue"] for r in jobs(pg, "state = 'running'"))

    # the long-lease judge at 21 s: the short-lease consumer is lost by its own lease; the
    # older row is judged by this sweeper's 60 s
    assert Sweeper(stores[60]).run_once(now=now + timedelta(seconds=21)).rescued == 1
    assert running() == ["long", "older"]
    # the short-lease judge at 21 s and at 59 s: the older row by its 20 s; never the consumer
    # whose own lease is 60 s
    assert Sweeper(stores[20]).run_once(now=now + timedelta(seconds=21)).rescued == 1
    assert Sweeper(stores[20]).run_once(now=now + timedelta(seconds=59)).rescued == 0
    assert running() == ["long"]
    # past its own lease, any judge rescues it
    assert Sweeper(stores[20]).run_once(now=now + timedelta(seconds=61)).rescued == 1
    assert running() == []


def test_health_metrics_and_the_workers_page_judge_each_consumer_by_its_own_lease(
        stores: dict[int, Store], pg: psycopg.Connection, client: FlaskClient) -> None:
    """Every consumer silent for 30 s: alive by a lease of 60 s, lost by 20 s -- its own, or
    (the older row) the judge's; the judges here are configured with 20 s."""
    owners = register(stores, pg)
    for consumer in owners.values():
        age_consumer(pg, consumer, 30)

    alive = {name: health.worker(pg, consumer=consumer, lease_timeout=20).status
             for name, consumer in owners.items()}
    assert alive == {"short": "stale", "long": "ok", "older": "stale"}
    assert health.queue(pg, name="long", lease_timeout=20).details["consumers_alive"] == 1

    snap = MetricsReader(lease_timeout=20).snapshot(pg)
    assert (snap.consumers_alive, snap.consumers) == (1, {"long": 1})

    html = client.get("/workers").text  # the app's lease_timeout is the default, 20 s
    for name, consumer in owners.items():
        section = html[html.index(f'data-consumer="{consumer}"'):]
        section = section[:section.index("</section>")]
        assert ("● alive" in section) == (name == "long"), (name, section)
