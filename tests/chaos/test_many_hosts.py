"""Workers on three hosts over one PostgreSQL: a shared drain, a host cut off, remote control.

Each host is a network namespace with an address of its own (tests/chaos/hosts.py), reaching a
PostgreSQL server of this module's own that listens on every host's gateway address; a cut is
the host's link taken down (packets dropped). Broker URLs carry ``tcp_user_timeout=3000`` (see
docs/chaos.md) and every worker has short leases (3 s). Counts from SQL; times printed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.chaos.hosts import Host, hosts, needs_hosts
from tests.chaos.load import tally
from tests.support.throwaway import ThrowawayServer, require_bindir
from tests.apps import e2e_app as e2e
from tests.support.workers import SHORT_LEASE, key_runs, owner_of, wait_state
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import WorkerProcess, wait_for

pytestmark = needs_hosts

NAP = "tests.apps.e2e_app.nap"


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[ThrowawayServer, list[Host]]]:
    """Three hosts and a server listening on 127.0.0.1 and on each host's gateway."""
    bindir = require_bindir()
    with hosts(3) as made:
        server = ThrowawayServer(bindir, listen=",".join(["127.0.0.1"] + [h.gateway for h in made]))
        try:
            server.init()
            net = made[0].gateway.rsplit(".", 2)[0]
            server.allow(f"host all all {net}.0.0/16 trust")
            server.start()
            yield server, made
        finally:
            server.destroy()


@pytest.fixture
def db(site: tuple[ThrowawayServer, list[Host]]) -> Iterator[str]:
    """A fresh migrated database (postgresql:// on 127.0.0.1), ``public.runs`` made, the e2e
    producer pointed at it."""
    server, _ = site
    url = server.create_database()
    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(e2e.RUNS_DDL)
    point_producer(e2e.app, "pgbroker+" + url)
    try:
        yield url
    finally:
        drop_pools(e2e.app)
        server.drop_database(url)


def _broker_on(host: Host, server: ThrowawayServer, db_url: str) -> str:
    """The broker URL a worker on ``host`` uses: the server at the host's gateway."""
    name = db_url.rsplit("/", 1)[1]
    return (f"pgbroker+postgresql://postgres@{host.gateway}:{server.port}/{name}"
            "?tcp_user_timeout=3000")


def _workers(site: tuple[ThrowawayServer, list[Host]], db_url: str, *args: str
             ) -> list[WorkerProcess]:
    server, made = site
    return [h.start_worker(_broker_on(h, server, db_url), "-c", "2", *args, options=SHORT_LEASE)
            for h in made]


def test_three_hosts_share_a_drain_each_task_once(site: tuple[ThrowawayServer, list[Host]],
                                                  db: str) -> None:
    workers = _workers(site, db)
    keys = [f"drain-{i:04}" for i in range(300)]
    started = time.monotonic()
    for key in keys:
        e2e.touch.apply_async((key,), task_id=key)
    with psycopg.connect(db, autocommit=True) as pg:
        wait_for(lambda: tally(pg, keys, task="tests.apps.e2e_app.touch").completed == len(keys),
                 120, interval=0.2, message="every task completed")
        elapsed = time.monotonic() - started
        result = tally(pg, keys, task="tests.apps.e2e_app.touch")
        pids = [r[0] for r in pg.execute("SELECT pid FROM public.runs WHERE key = ANY(%s)",
                                         (keys,))]
    per_host = [sum(1 for pid in pids if owner_of(pid, *workers) is w) for w in workers]
    assert result.lost == 0 and result.duplicated == 0 and result.rows == len(keys)
    assert all(per_host), per_host  # every host took part
    print("\n" + result.line("3 hosts share a drain",
                             f"tasks per host {per_host}; {len(keys) / elapsed:.0f} tasks/s "
                             "publish to last completion"))


def test_a_host_cut_off_its_jobs_rescued_its_late_acks_ignored(
        site: tuple[ThrowawayServer, list[Host]], db: str) -> None:
    server, made = site
    cut_host, others = made[0], made[1:]
    cut_off = cut_host.start_worker(_broker_on(cut_host, server, db), "-c", "2",
                                    options=SHORT_LEASE)
    keys = [f"cut-{i}" for i in range(2)]
    for key in keys:
        e2e.nap.apply_async((key, 14), task_id=key)  # outlasts the cut: its end is recorded
    with psycopg.connect(db, autocommit=True) as pg:
        wait_for(lambda: all(key_runs(pg, k) for k in keys), 30, interval=0.1,
                 message="both naps running on the first host")
        helpers = [h.start_worker(_broker_on(h, server, db), "-c", "2", options=SHORT_LEASE)
                   for h in others]
        cut_at = time.monotonic()
        cut_host.cut()
        try:
            wait_for(lambda: all(len(key_runs(pg, k)) >= 2 for k in keys), 60, interval=0.1,
                     message="the cut-off host's jobs to run again on another host")
            rescued = time.monotonic() - cut_at
            time.sleep(max(0.0, cut_at + 8 - time.monotonic()))  # the scenario: an 8 s cut
        finally:
            cut_host.heal()
        # the cut-off host's copies finish now; their acks (attempt 1) change nothing
        wait_for(lambda: all(len(key_runs(pg, k + ":done")) == 2 for k in keys), 90,
                 interval=0.2, message="both copies of each nap to finish")
        for key in keys:  # the rescuer's copy writes its end a moment before its ack
            wait_state(pg, key, "completed", timeout=30)
        rows = pg.execute("SELECT state, attempts FROM pgbroker.jobs WHERE task_id = ANY(%s)",
                          (keys,)).fetchall()
        rerun_by = {owner_of(key_runs(pg, k)[1]["pid"], cut_off, *helpers).name for k in keys}
        result = tally(pg, keys, task=NAP)
    assert rows == [("completed", 2)] * 2
    assert cut_off.name not in rerun_by
    assert result.lost == 0 and result.duplicated == 2  # exactly the two jobs in flight
    assert cut_off.is_alive()
    print("\n" + result.line("a host cut off (link down, 2 jobs in flight)",
                             f"jobs running again on another host {rescued:.2f}s after the cut "
                             f"(lease_timeout {SHORT_LEASE['lease_timeout']}s)"))


def test_celery_inspect_reaches_every_host(site: tuple[ThrowawayServer, list[Host]],
                                           db: str) -> None:
    workers = _workers(site, db)
    inspect = e2e.app.control.inspect(timeout=5)
    replies = wait_for(lambda: (found := inspect.ping() or {}) and len(found) == 3 and found,
                       60, interval=0.5, message="a ping reply from every host")
    queues = inspect.active_queues() or {}
    assert sorted(name.split("-", 1)[0] for name in replies) == ["host1", "host2", "host3"]
    assert len(queues) == 3 and all(q and q[0]["name"] == "celery" for q in queues.values())
    assert all(w.is_alive() for w in workers)
    print(f"\n[figure] celery inspect ping across 3 hosts: {len(replies)} replies "
          f"(pid {os.getpid()} asking from the database's machine)")
