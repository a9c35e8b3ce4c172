"""``celery inspect``, ``celery control``, ``celery purge`` and ``celery status`` against real
``celery worker`` processes over pgbroker, through the command line (a subprocess, as an operator
runs it) and through ``app.control`` (as Flower and scripts do).

How it works over PostgreSQL: a request is a broadcast (one ``broadcasts`` row, a NOTIFY with its
id) to the workers' mailbox queues bound to the ``celery.pidbox`` fanout exchange; each worker
replies with a transient message to the client's reply queue (``<oid>.reply.celery.pidbox``,
``x-expires`` 10 s), routed through the ``bindings`` table. Figures are printed, not asserted.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from pgbroker._pg.store import Store
from pgbroker.settings import Settings
from pgbroker.sweeper import Sweeper
from tests.apps import e2e_app as e2e
from tests.support.control import (
    REPLY_QUEUES,
    REPLY_TIMEOUT,
    all_replies,
    celery_cli,
    cli_json,
    client_app,
    leftovers,
    node,
    start_celery,
    start_workers,
    timed_ping,
)
from tests.support.workers import job, key_runs, owner_of, wait_state
from tests.support.processes import wait_for


def test_inspect_answers_from_two_workers_with_tasks_running(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    a, b = start_workers(broker_url, ("-Q", "qa", "-c", "1", "--prefetch-multiplier", "2"),
                         ("-Q", "qb", "-c", "1"))
    na, nb = node(a), node(b)
    running_a = e2e.nap.apply_async(("nap-a", 120), queue="qa")
    running_b = e2e.nap.apply_async(("nap-b", 120), queue="qb")
    reserved_a = e2e.nap.apply_async(("nap-a2", 120), queue="qa")  # A's second prefetch slot
    later = e2e.touch.apply_async(("later",), countdown=600, queue="qa")
    wait_for(lambda: key_runs(runs, "nap-a") and key_runs(runs, "nap-b"), 60,
             message="both naps to start")
    wait_state(runs, reserved_a.id, "running")  # claimed by A, waiting for its only process

    # -- the command line ----------------------------------------------------------------------
    assert cli_json(broker_url, "inspect", "ping") == {na: {"ok": "pong"}, nb: {"ok": "pong"}}
    active = cli_json(broker_url, "inspect", "active")
    assert {name: [t["id"] for t in tasks] for name, tasks in active.items()} == {
        na: [running_a.id], nb: [running_b.id]}
    assert active[na][0]["delivery_info"]["routing_key"] == "qa"
    status = celery_cli(broker_url, "status", "-t", str(REPLY_TIMEOUT)).stdout
    assert f"->  {na}: OK" in status and f"->  {nb}: OK" in status
    assert "2 nodes online." in status

    # -- the Python API (each call waits REPLY_TIMEOUT for every reply) --------------------------
    inspect = producer.control.inspect(timeout=REPLY_TIMEOUT)
    pongs, arrived = timed_ping(producer)
    assert pongs == {na: {"ok": "pong"}, nb: {"ok": "pong"}}
    shown = ", ".join(f"{name.split('@')[0]} {t * 1000:.0f} ms" for name, t in arrived.items())
    print(f"\n[figure] inspect ping round trip, 2 workers each running a task: {shown}")
    assert {n: [t["id"] for t in ts] for n, ts in inspect.active().items()} == {
        na: [running_a.id], nb: [running_b.id]}
    assert {n: [t["id"] for t in ts] for n, ts in inspect.reserved().items()} == {
        na: [reserved_a.id], nb: []}
    # An eta task waits in the database (state 'scheduled') until due, never in a worker's
    # memory: each worker lists the scheduled jobs of the queues it consumes, as Celery would
    # list its timer's (pgbroker._celery.inspect_scheduled).
    assert job(runs, later.id)["state"] == "scheduled"
    scheduled = cli_json(broker_url, "inspect", "scheduled")
    assert scheduled[nb] == [] and len(scheduled[na]) == 1
    entry = scheduled[na][0]
    assert datetime.fromisoformat(entry["eta"]) == job(runs, later.id)["run_at"]
    assert (entry["request"]["id"], entry["request"]["name"], entry["request"]["args"],
            entry["request"]["hostname"]) == (later.id, "tests.apps.e2e_app.touch", ["later"], na)
    assert inspect.scheduled() == scheduled
    stats = inspect.stats()
    assert set(stats) == {na, nb}
    for name in (na, nb):
        assert stats[name]["broker"]["transport"] == "pgbroker"
        assert stats[name]["pool"]["max-concurrency"] == 1
    registered = inspect.registered()
    assert "tests.apps.e2e_app.nap" in registered[na]
    assert "tests.apps.e2e_app.touch" in registered[nb]
    found = inspect.query_task(running_a.id, reserved_a.id, running_b.id, later.id)
    assert {name: {tid: info[0] for tid, info in tasks.items()}
            for name, tasks in found.items()} == {
        na: {running_a.id: "active", reserved_a.id: "reserved"},
        nb: {running_b.id: "active"}}
    for worker in (a, b):  # the naps would make a warm shutdown wait for them
        worker.kill_group()


def test_control_commands_change_the_running_workers(
        producer: Celery, runs: psycopg.Connection, broker_url: str) -> None:
    a, b = start_workers(broker_url, (), ())
    na, nb = node(a), node(b)
    both = {na, nb}
    # due in 20 s: the steps below take about that long, so the wait for them costs little
    revoked = e2e.touch.apply_async(("revoked",), countdown=20)
    kept = e2e.touch.apply_async(("kept",), countdown=20)

    # revoke of a queued task: every worker remembers it, and its job is cancelled in the
    # database (pgbroker._produce.revoke), so it is never delivered
    replies = cli_json(broker_url, "control", "revoke", revoked.id)
    assert replies == {n: {"ok": f"tasks {{'{revoked.id}'}} flagged as revoked"} for n in both}
    assert job(runs, revoked.id)["state"] == "cancelled"

    assert cli_json(broker_url, "control", "rate_limit", "tests.apps.e2e_app.boom", "7/m") == {
        n: {"ok": "new rate limit set successfully"} for n in both}
    inspect = producer.control.inspect(timeout=REPLY_TIMEOUT)
    assert all("tests.apps.e2e_app.boom [rate_limit=7/m]" in tasks
               for tasks in inspect.registered("rate_limit").values())

    # pool_grow / pool_shrink on A only (-d): A's pool has 3 processes, then 2 again
    assert cli_json(broker_url, "control", "pool_grow", "1", "-d", na) == {
        na: {"ok": "pool will grow"}}
    wait_for(lambda: pool_sizes(inspect, both) == {na: 3, nb: 2}, 60,
             message=lambda: f"A's pool to grow to 3 ({pool_sizes(inspect, both)})")
    assert cli_json(broker_url, "control", "pool_shrink", "1", "-d", na) == {
        na: {"ok": "pool will shrink"}}
    wait_for(lambda: pool_sizes(inspect, both) == {na: 2, nb: 2}, 60,
             message=lambda: f"A's pool to shrink to 2 ({pool_sizes(inspect, both)})")

    # add_consumer: A consumes a new queue, and a task sent there runs on A
    assert cli_json(broker_url, "control", "add_consumer", "extra_q", "-d", na) == {
        na: {"ok": "add consumer extra_q"}}
    e2e.touch.apply_async(("extra",), queue="extra_q")
    wait_for(lambda: key_runs(runs, "extra"), 60, message="the task sent to extra_q to run")
    assert owner_of(key_runs(runs, "extra")[0]["pid"], a, b) is a
    queues = all_replies(inspect.active_queues, both)
    assert "extra_q" in [q["name"] for q in queues[na]]
    assert "extra_q" not in [q["name"] for q in queues[nb]]

    # cancel_consumer: A stops consuming it; a new task there waits (the purge below counts it)
    assert cli_json(broker_url, "control", "cancel_consumer", "extra_q", "-d", na) == {
        na: {"ok": "no longer consuming from extra_q"}}
    assert "extra_q" not in [q["name"] for q in all_replies(inspect.active_queues, both)[na]]
    waiting = e2e.touch.apply_async(("extra-after-cancel",), queue="extra_q")

    # purge: pending and scheduled messages of the named queues are deleted and counted
    for n in range(3):
        e2e.touch.apply_async((f"purged{n}",), queue="purge_q")
    e2e.touch.apply_async(("purged-later",), queue="purge_q", countdown=600)
    done = celery_cli(broker_url, "purge", "-f", "-Q", "purge_q,extra_q")
    assert "Purged 5 messages from 2 known task queues." in done.stdout
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs WHERE queue IN "
                        "('purge_q', 'extra_q') AND state IN ('pending', 'scheduled')"
                        ).fetchone()[0] == 0
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_id = %s",
                        (waiting.id,)).fetchone()[0] == 0

    # the revoked task came due meanwhile: never delivered (still cancelled), its sibling ran
    wait_state(runs, kept.id, "completed", timeout=60)  # the sibling ran
    assert job(runs, revoked.id)["state"] == "cancelled"
    assert key_runs(runs, "revoked") == []

    # status, then shutdown of A alone
    assert "2 nodes online." in celery_cli(broker_url, "status", "-t", str(REPLY_TIMEOUT)).stdout
    # a worker never replies to shutdown (it raises WorkerShutdown at once, on RabbitMQ too),
    # so the command reports "No nodes replied" and exits 69 (EX_UNAVAILABLE)
    done = celery_cli(broker_url, "control", "shutdown", "-d", na, check=False)
    assert done.returncode == 69 and "No nodes replied" in done.stderr
    assert a.wait(60) == 0
    assert "Got shutdown from remote" in a.log()
    assert b.is_alive()
    assert all_replies(inspect.ping, [nb]) == {nb: {"ok": "pong"}}
    assert "1 node online." in celery_cli(broker_url, "status", "-t", str(REPLY_TIMEOUT)).stdout


def test_broadcasts_reach_every_worker_and_replies_leave_nothing_behind(
        runs: psycopg.Connection, broker_url: str, db_url: str, tmp_path: Path) -> None:
    a, b = start_workers(broker_url, ("-c", "1"), ("-c", "1"))
    both = {node(a), node(b)}
    with client_app(broker_url) as client:
        blob = "".join(f"{n:08x}" for n in range(2500))  # 20 000 bytes, > pg_notify's 8000
        digest = {"size": len(blob), "sha256": hashlib.sha256(blob.encode()).hexdigest()}
        replies = client.control.broadcast("payload_digest", arguments={"payload": blob},
                                           reply=True, timeout=REPLY_TIMEOUT)
        assert sorted(replies, key=str) == sorted(({n: {"ok": digest}} for n in both), key=str)

        answered = 0
        for _ in range(100):
            answered += len(client.control.inspect(timeout=0.2).ping() or {})
        print(f"\n[figure] 100 inspect ping calls (0.2 s each) to 2 workers: {answered} of "
              f"200 replies within the timeout")
        assert answered > 0  # the calls reached the workers
        # a worker reads its mailbox in order: once this is answered, every request was handled
        assert set(client.control.inspect(timeout=REPLY_TIMEOUT).ping()) == both
    # Each call deleted its reply queue and binding when it stopped consuming (auto_delete).
    print(f"[figure] left by 101 calls: {leftovers(runs)}")
    assert {k: v for k, v in leftovers(runs).items() if k != "broadcasts"} == {
        "queues": 0, "bindings": 0, "jobs": 0}

    # A client killed while it waits leaves its reply queue, and the replies that come after.
    since = runs.execute("SELECT clock_timestamp()").fetchone()[0]
    killed = start_celery(broker_url, "killed-client", "control", "slow_pong", "1.5",
                          "-t", "60", log_dir=tmp_path)
    wait_for(lambda: broadcasts_since(runs, since), 60, message="the slow_pong request")
    killed.kill_group()
    wait_for(lambda: leftovers(runs)["jobs"] == 2, 60, message="the two orphaned replies")
    assert leftovers(runs)["queues"] == leftovers(runs)["bindings"] == 1

    # x-expires (10 s) and the broadcasts' minute pass (aged with SQL instead of waiting): one
    # sweep removes everything the clients left.
    runs.execute("UPDATE pgbroker.queues SET last_used_at = now() - interval '1 hour'"
                 " WHERE name LIKE %s", (REPLY_QUEUES,))
    runs.execute("UPDATE pgbroker.broadcasts SET created_at = now() - interval '61 s'")
    store = Store(db_url, Settings())
    try:
        Sweeper(store).run_once()
    finally:
        store.close()
    assert leftovers(runs) == {"queues": 0, "bindings": 0, "jobs": 0, "broadcasts": 0}
    # what is left is the workers' own: their queues, mailboxes and bindings
    assert sorted(r[0] for r in runs.execute("SELECT name FROM pgbroker.queues")) == \
        sorted(["celery", *(f"{n}.celery.pidbox" for n in both)])
    assert runs.execute("SELECT count(*) FROM pgbroker.bindings").fetchone()[0] == 3
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 0
    with client_app(broker_url) as client:  # the workers' mailboxes were not swept
        assert set(all_replies(client.control.inspect(timeout=REPLY_TIMEOUT).ping, both)) == both


def broadcasts_since(pg: psycopg.Connection, since: Any) -> int:
    return pg.execute("SELECT count(*) FROM pgbroker.broadcasts WHERE created_at > %s",
                      (since,)).fetchone()[0]


def pool_sizes(inspect: Any, nodes: set[str]) -> dict[str, int]:
    """Pool processes per node, from ``inspect stats``."""
    return {name: len(stats["pool"]["processes"])
            for name, stats in all_replies(inspect.stats, nodes).items()}


def test_inspect_right_after_an_early_return_is_answered(broker_url: str,
                                                         runs: psycopg.Connection) -> None:
    [worker] = start_workers(broker_url, ("-c", "1"))
    name = node(worker)
    with client_app(broker_url) as client:
        # destination=[one node]: the call returns at the first reply, as Flower's per-worker
        # refresh and `celery inspect -d` do
        answered = [client.control.ping(destination=[name], timeout=REPLY_TIMEOUT)
                    for _ in range(5)]
    assert answered == [[{name: {"ok": "pong"}}]] * 5

