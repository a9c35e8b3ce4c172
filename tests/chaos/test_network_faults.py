"""Chaos on the network between a worker and PostgreSQL: a connection that hangs, and a network
partition.

Two different failures, with different cures:

* **A hung peer** (``TcpProxy.pause()``): the proxy stops forwarding but its kernel still
  acknowledges every packet, as a stuck server, PgBouncer or middlebox would. No TCP mechanism
  (keepalives, ``tcp_user_timeout``) can see it; the worker's calls block until the path comes
  back. What must hold: the stuck worker's heartbeats stop, so another worker's sweeper rescues
  its jobs after ``lease_timeout``, and the stuck worker carries on when the path comes back,
  its late acks changing nothing.
* **A partition** (packets dropped): the proxy runs in a network namespace of its own whose
  loopback the test takes down (``ip link set lo down``); this needs root and ``unshare``,
  ``nsenter`` and ``ip`` (skipped otherwise). Here the kernel gives up on unacknowledged data
  after ``tcp_user_timeout`` and on idle connections after the keepalives pgbroker sets
  (10 s + 3 x 5 s): the worker notices, reconnects once the network is back, and meanwhile its
  jobs are rescued elsewhere.

Real ``celery worker`` processes; counts from SQL, times printed (``pytest -s``), not asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from celery import Celery

from pgbroker._pg.store import Store
from pgbroker.settings import Settings
from tests.chaos.load import tally
from tests.support.throwaway import ThrowawayServer
from tests.chaos.tcp_proxy import TcpProxy
from tests.apps import e2e_app as e2e
from tests.support.workers import SHORT_LEASE, key_runs, start_worker, wait_state
from tests.support.producers import drop_pools, point_producer
from tests.support import processes as helpers
from tests.support.db import db_now
from tests.support.processes import REPO_ROOT, WorkerProcess, wait_for

NAP = "tests.apps.e2e_app.nap"

#: Seconds a partition lasts at least: several lease timeouts and worker-heartbeat events, so
#: every connection of the worker that is used meanwhile breaks.
PARTITION = 8


def _through(db_url: str, port: int, query: str = "") -> str:
    """``db_url`` (postgresql://) pointed at 127.0.0.1:``port``, as a broker URL."""
    parts = urlsplit(db_url)
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@127.0.0.1:{port}" if user else f"127.0.0.1:{port}"
    return "pgbroker+" + urlunsplit(parts._replace(netloc=netloc, query=query))


def _publish_naps(prefix: str, count: int, seconds: float) -> list[str]:
    keys = [f"{prefix}-{i}" for i in range(count)]
    for key in keys:
        e2e.nap.apply_async((key, seconds), task_id=key)
    return keys


def _running_in(pg: psycopg.Connection, keys: list[str], worker: WorkerProcess) -> bool:
    """Every key has started, each in a pool process of ``worker``."""
    pids = set(worker.child_pids())
    starts = [key_runs(pg, k) for k in keys]
    return all(s and s[0]["pid"] in pids for s in starts)


def _rerun_by(pg: psycopg.Connection, keys: list[str], worker: WorkerProcess) -> datetime | None:
    """When the last of ``keys`` started again in ``worker`` (None until all have)."""
    pids = set(worker.child_pids())
    again = [next((r["at"] for r in key_runs(pg, k)[1:] if r["pid"] in pids), None)
             for k in keys]
    return None if None in again else max(again)  # type: ignore[type-var]


def _log_stamps(worker: WorkerProcess, text: str) -> list[float]:
    """Epoch times (the worker's clock) of every log line of ``worker`` containing ``text``."""
    stamps = []
    for line in worker.log().splitlines():
        match = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}):", line)
        if match and text in line:
            stamps.append(datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp()
                          + int(match[2]) / 1000)
    return stamps


def _standby(broker_url: str) -> WorkerProcess:
    """A worker that sweeps (every second) but consumes only an unused queue until
    :func:`_take_over`: started before the jobs under test, so none of them goes to it."""
    return start_worker(broker_url, "-c", "2", "-Q", "standby", options=SHORT_LEASE)


def _take_over(pg: psycopg.Connection, worker: WorkerProcess) -> None:
    """Make ``worker`` consume ``celery`` too (remote control), and wait until it does."""
    e2e.app.control.add_consumer("celery", destination=[f"{worker.name}@{socket.gethostname()}"])
    wait_for(lambda: pg.execute(
        "SELECT count(*) FROM pgbroker.consumers WHERE pid = %s AND 'celery' = ANY(queues)",
        (worker.pid,)).fetchone()[0], 30, interval=0.1, message="the standby to consume celery")


def _probe(pg: psycopg.Connection, worker: WorkerProcess, key: str) -> float:
    """Publish a task only ``worker`` can take; return its publish->start latency (s)."""
    result = e2e.touch.delay(key)
    row = wait_state(pg, result.id, "completed", timeout=90)
    [run] = key_runs(pg, key)
    assert run["pid"] in worker.child_pids()
    return (run["at"] - row["created_at"]).total_seconds()


# -- what the kernel is told -----------------------------------------------------------------------

@pytest.mark.parametrize(("option", "sockopt", "value"), [
    ("tcp_user_timeout", socket.TCP_USER_TIMEOUT, 3000),
    pytest.param("keepalives_idle", socket.TCP_KEEPIDLE, 2),
], ids=["tcp_user_timeout", "keepalives_idle"])
def test_tcp_options_in_the_url_reach_the_socket(db_url: str, option: str, sockopt: int,
                                                 value: int) -> None:
    """The partition test passes ``tcp_user_timeout`` in the URL; an operator tunes keepalives
    the same way. Read back from the kernel what a pgbroker connection's socket got."""
    store = Store(f"{db_url}?{option}={value}", Settings(auto_migrate=False))
    try:
        conn = store.connect()
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            assert sock.getsockopt(socket.IPPROTO_TCP, sockopt) == value
        finally:
            sock.close()
    finally:
        store.close()


# -- a hung peer: the proxy stops forwarding -------------------------------------------------------

def test_hung_connection_jobs_rescued_and_worker_carries_on(
        producer: Celery, runs: psycopg.Connection, db_url: str, broker_url: str) -> None:
    with TcpProxy(("127.0.0.1", runs.info.port)) as proxy:
        helper = _standby(broker_url)
        stuck = start_worker(_through(db_url, proxy.port), "-c", "2", options=SHORT_LEASE)
        keys = _publish_naps("hung", 2, 8)
        wait_for(lambda: _running_in(runs, keys, stuck), 30, message="both naps in the worker")
        _take_over(runs, helper)

        paused_at = db_now(runs)
        proxy.pause()
        rerun_at = wait_for(lambda: _rerun_by(runs, keys, helper), 60, interval=0.1,
                            message="the stuck worker's jobs to run again in the other one")
        for key in keys:
            wait_state(runs, key, "completed", timeout=60)
        noticed = "Connection to broker lost" in stuck.log()
        proxy.resume()

        helper.stop()
        latency = _probe(runs, stuck, "after-resume")  # the stuck worker works again
        # its own copies finish now; their acks (of attempt 1) change nothing
        wait_for(lambda: all(len(key_runs(runs, k + ":done")) == 2 for k in keys), 60,
                 message="the stuck worker's copies to finish")
        result = tally(runs, keys, task=NAP)
        rows = runs.execute("SELECT state, attempts FROM pgbroker.jobs WHERE task_id = ANY(%s)",
                            (keys,)).fetchall()
    assert rows == [("completed", 2)] * 2
    assert result.lost == 0 and result.duplicated == 2  # exactly the two jobs in flight
    assert stuck.is_alive()
    print("\n" + result.line(
        "connection hangs (proxy stops forwarding, 2 jobs in flight)",
        f"jobs running again elsewhere {(rerun_at - paused_at).total_seconds():.2f}s after "
        f"the hang began (lease_timeout {SHORT_LEASE['lease_timeout']}s); the stuck worker "
        f"{'noticed' if noticed else 'could not notice'} the hang (the peer kernel still "
        f"acknowledges); after the path came back it ran a new task "
        f"{latency * 1000:.0f} ms after its publish"))


# -- a partition: packets dropped ------------------------------------------------------------------

_TOOLS = ("unshare", "nsenter", "ip")
_partition_possible = os.geteuid() == 0 and all(shutil.which(t) for t in _TOOLS)
needs_netns = pytest.mark.skipif(
    not _partition_possible,
    reason="a partition needs root and unshare, nsenter and ip (a private network namespace)")


class NamespacedProxy:
    """A :class:`TcpProxy` subprocess alone in a new network namespace, forwarding to a unix
    socket (which crosses namespaces); the test takes its loopback down and up."""

    def __init__(self, unix_socket: str):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--", sys.executable, "-m", "tests.chaos.tcp_proxy",
             "--own-loopback", f"unix:{unix_socket}"],
            stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", "--"]

    def link(self, state: str) -> None:
        subprocess.run(self.enter() + ["ip", "link", "set", "lo", state], check=True)

    def start_worker(self, broker_url: str, *args: str,
                     options: dict[str, object] | None = None) -> WorkerProcess:
        """A ``celery worker`` of tests.apps.e2e_app inside the namespace (so its only way to the
        database is the proxy)."""
        name = f"ns{os.getpid()}-{time.monotonic_ns()}"
        env = {"PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(options or {})}
        argv = self.enter() + [sys.executable, "-m", "celery", "-A", "tests.apps.e2e_app", "worker",
                               "-P", "prefork", "--loglevel=INFO", "-n", f"{name}@%h", *args]
        # tests.support.processes builds the environment and log path of every worker; reused as is
        return WorkerProcess(argv, helpers._env(broker_url, env),
                             helpers._log_path(None, name), name).wait_ready(60)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def namespaced(own_server: ThrowawayServer, own_db: str) -> Iterator[tuple[NamespacedProxy, str]]:
    """(the proxy, the database URL) with ``public.runs`` made and the producer pointed there."""
    with psycopg.connect(own_db, autocommit=True) as pg:
        pg.execute(e2e.RUNS_DDL)
    point_producer(e2e.app, "pgbroker+" + own_db)
    proxy = NamespacedProxy(own_server.socket_path)
    try:
        yield proxy, own_db
    finally:
        proxy.close()
        drop_pools(e2e.app)


@needs_netns
@pytest.mark.parametrize("tcp_user_timeout", [
    3000,
    pytest.param(None, marks=[pytest.mark.slow]),
], ids=["tcp_user_timeout=3s", "libpq-defaults"])
def test_partition_detected_jobs_rescued_worker_reconnects(
        namespaced: tuple[NamespacedProxy, str], tcp_user_timeout: int | None) -> None:
    ns, db_url = namespaced
    query = f"tcp_user_timeout={tcp_user_timeout}" if tcp_user_timeout else ""
    helper = _standby("pgbroker+" + db_url)
    cut_off = ns.start_worker(_through(db_url, ns.port, query), "-c", "2", options=SHORT_LEASE)
    with psycopg.connect(db_url, autocommit=True) as pg:
        keys = _publish_naps("cut", 2, 8)
        wait_for(lambda: _running_in(pg, keys, cut_off), 30, message="both naps in the worker")
        _take_over(pg, helper)

        cut_at, cut_wall = db_now(pg), time.time()
        ns.link("down")
        try:
            rerun_at = wait_for(lambda: _rerun_by(pg, keys, helper), 60, interval=0.1,
                                message="the cut-off worker's jobs to run again elsewhere")
            # the lease thread's heartbeat is the first query sent into the partition
            noticed = wait_for(lambda: _log_stamps(cut_off, "pgbroker lease"), 60,
                               interval=0.5, message="the cut-off worker to notice")[0]
            # the scenario: the partition lasts PARTITION seconds
            time.sleep(max(0.0, cut_wall + PARTITION - time.time()))
        finally:
            ns.link("up")
        healed_at = db_now(pg)
        for key in keys:
            wait_state(pg, key, "completed", timeout=60)
        helper.stop()
        latency = _probe(pg, cut_off, "after-heal")
        result = tally(pg, keys, task=NAP)
    assert result.lost == 0 and result.completed == 2
    assert cut_off.is_alive()
    print("\n" + result.line(
        f"network partition (tcp_user_timeout={tcp_user_timeout or 'unset'}, 2 jobs in flight)",
        f"jobs running again elsewhere {(rerun_at - cut_at).total_seconds():.2f}s after the "
        f"cut; the worker's lease noticed after {noticed - cut_wall:.1f}s; partition healed "
        f"after {(healed_at - cut_at).total_seconds():.1f}s; then the worker ran a new task "
        f"{latency * 1000:.0f} ms after its publish"))
