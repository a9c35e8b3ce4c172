"""Concurrency keys (issue 22, point 2) against a real PostgreSQL: the claim statement itself,
from several consumers (threads, each with its own connection) at once.

A job with ``concurrency_key`` is claimed only into a free slot of its key (at most
``concurrency_limit`` running); jobs with other keys or none are claimed past it. Whatever makes a
keyed job leave 'running' frees its slot (ack, requeue, rescue, delete). With real workers and
SIGKILL: tests/e2e/test_job_keys_worker.py.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import psycopg

from pgbroker._pg.store import Store
from pgbroker.sweeper import Sweeper
from tests.support.transport import age_consumer, counts, new_job, store_for


def keyed(key: str | None, limit: int | None = None, **fields: Any) -> Any:
    headers: dict[str, Any] = {}
    if key is not None:
        headers["concurrency_key"] = key
    if limit is not None:
        headers["concurrency_limit"] = limit
    return new_job("q", headers=headers, task="t.sync", **fields)


def running_per_key(pg: psycopg.Connection) -> dict[str, int]:
    return dict(pg.execute("SELECT concurrency_key, count(*) FROM pgbroker.jobs"
                           " WHERE state = 'running' AND concurrency_key IS NOT NULL"
                           " GROUP BY 1").fetchall())


def slots(pg: psycopg.Connection) -> dict[str, int]:
    return dict(pg.execute("SELECT key, running FROM pgbroker.concurrency_keys").fetchall())


def test_one_at_a_time_and_the_others_flow_past(store: Store, pg: psycopg.Connection) -> None:
    store.insert_many([keyed("source:42") for _ in range(5)] + [keyed(None) for _ in range(5)])
    consumer = uuid.uuid4()
    first = store.claim("q", 10, consumer)
    # one of the key, and all five unkeyed ones (the batch was not cut short by the key)
    assert sorted(r.headers.get("concurrency_key") or "-" for r in first) == (
        ["-"] * 5 + ["source:42"])
    assert slots(pg) == {"source:42": 1}
    assert store.claim("q", 10, consumer) == []  # the key's slot is taken
    [one] = [r for r in first if r.headers.get("concurrency_key")]
    assert store.ack([(one.id, one.attempt)]) == 1
    assert slots(pg) == {"source:42": 0}
    [second] = store.claim("q", 10, consumer)
    assert second.headers["concurrency_key"] == "source:42"


def test_a_keyed_job_waiting_never_takes_a_slot_of_the_batch(store: Store,
                                                            pg: psycopg.Connection) -> None:
    """Fifty keyed jobs at the head of the queue, their key busy: a claim of 10 still gets the
    10 unkeyed jobs behind them, every time."""
    store.insert_many([keyed("busy") for _ in range(50)] + [keyed(None) for _ in range(30)])
    consumer = uuid.uuid4()
    assert len(store.claim("q", 10, consumer)) == 10  # 1 keyed + 9 unkeyed (filled past it)
    for _ in range(2):
        rows = store.claim("q", 10, consumer)
        assert len(rows) == 10 and not any(r.headers.get("concurrency_key") for r in rows)
    assert running_per_key(pg) == {"busy": 1}


def test_a_limit_of_n_runs_n_at_a_time(store: Store, pg: psycopg.Connection) -> None:
    store.insert_many([keyed("api", 3) for _ in range(10)])
    consumer = uuid.uuid4()
    assert len(store.claim("q", 10, consumer)) == 3
    assert store.claim("q", 10, consumer) == []
    assert running_per_key(pg) == {"api": 3} and slots(pg) == {"api": 3}


def test_every_way_out_of_running_frees_the_slot(store: Store, db_url: str,
                                                 pg: psycopg.Connection) -> None:
    store.insert_many([keyed(f"k{n}") for n in range(4)])
    consumer = uuid.uuid4()
    store.register_consumer(consumer, ["q"], None)
    rows = {r.headers["concurrency_key"]: r for r in store.claim("q", 10, consumer)}
    assert slots(pg) == {"k0": 1, "k1": 1, "k2": 1, "k3": 1}
    store.ack([(rows["k0"].id, 1)])
    store.requeue([(rows["k1"].id, 1)])
    store.bury(rows["k2"].id, 1, "bad")
    deleting = store_for(db_url, retention=0)
    try:
        deleting.ack([(rows["k3"].id, 1)])  # retention 0: the row is deleted
    finally:
        deleting.close()
    assert slots(pg) == {"k0": 0, "k1": 0, "k2": 0, "k3": 0}
    # the requeued one runs again; its consumer is lost: the sweeper's rescue frees it
    [again] = store.claim("q", 10, consumer)
    assert slots(pg)["k1"] == 1
    age_consumer(pg, consumer, 3600)
    assert Sweeper(store).run_once().rescued == 1
    assert slots(pg)["k1"] == 0 and counts(pg)["pending"] == 1


def test_concurrent_claims_of_four_consumers_never_exceed_the_limit(
        db_url: str, pg: psycopg.Connection) -> None:
    """Four consumers claim and ack as fast as they can while a fifth connection watches: no
    key ever has more running jobs than its limit, and every job runs exactly once."""
    keys = {f"key{n}": 1 + n % 3 for n in range(6)}  # limits 1, 2, 3
    seeder = store_for(db_url)
    jobs = [keyed(key, limit) for _ in range(40) for key, limit in keys.items()]
    jobs += [keyed(None) for _ in range(100)]
    random.shuffle(jobs)
    seeder.insert_many(jobs)
    seeder.close()
    stop = threading.Event()
    seen: list[str] = []
    over: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def consume() -> None:
        store = store_for(db_url)
        consumer = uuid.uuid4()
        try:
            held: list[tuple[uuid.UUID, int]] = []
            deadline = time.monotonic() + 60  # a stuck key fails the test, with the counts
            while time.monotonic() < deadline:
                # the finished deliveries are acked by the next claim, as a worker does; those
                # it could not wait for (another claim held their key's row) are acked apart
                locked: list[tuple[uuid.UUID, int]] = []
                rows = store.claim("q", random.randint(1, 8), consumer, acks=held,
                                   locked=locked)
                # an ack meeting a row lock (a claim's SKIP LOCKED scan may hold a row it
                # found changed) is tried again later, as the transport does (settle_later)
                later: list[tuple[uuid.UUID, int]] = []
                store.ack(locked, locked=later)
                held = [(r.id, r.attempt) for r in rows] + later
                seen.extend(str(r.id) for r in rows)
                if not held and store.queue_size("q") == 0:
                    return
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            store.close()

    def watch() -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            while not stop.is_set():
                now = running_per_key(conn)
                if any(n > keys[k] for k, n in now.items()):
                    over.append(now)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    watcher.join(10)
    assert not errors, errors
    assert not over, over[:5]
    assert len(seen) == len(set(seen)) == len(jobs)  # each claimed exactly once
    assert counts(pg) == {"completed": len(jobs)}, (slots(pg), running_per_key(pg))
    assert set(slots(pg).values()) == {0}


def test_the_sweeper_prunes_keys_idle_for_an_hour(store: Store, pg: psycopg.Connection) -> None:
    store.insert_many([keyed("old"), keyed("busy"), keyed("recent")])
    consumer = uuid.uuid4()
    store.register_consumer(consumer, ["q"], None)  # alive: its running job is not rescued
    rows = {r.headers["concurrency_key"]: r for r in store.claim("q", 10, consumer)}
    store.ack([(rows["old"].id, 1), (rows["recent"].id, 1)])
    pg.execute("UPDATE pgbroker.concurrency_keys SET updated_at = now() - interval '2 hours'"
               " WHERE key IN ('old', 'busy')")
    assert Sweeper(store).run_once().keys == 1
    assert slots(pg) == {"busy": 1, "recent": 0}  # a running one is kept, however old
