"""A failover whose old primary black-holes: its packets vanish (no RST, no FIN, no ICMP) while
the standby is promoted.

``tests/chaos/test_failover.py`` crashes the primary with ``pg_ctl -m immediate`` on this
machine: every client gets a reset or "connection refused" at once. In a cloud failover, with
Patroni moving a VIP, or in a zone outage, the old primary's address usually goes *dark*
instead: what is sent to it is never answered and never refused. Only the client's own TCP
timers can tell -- ``tcp_user_timeout`` for data sent and not acknowledged, the keepalives for
an idle connection, ``connect_timeout`` for a connection attempt -- and a worker or producer
waiting without one is an outage.

The site: a worker host (a network namespace, tests/chaos/hosts.py) reaches the primary and its
synchronous standby (tests/chaos/replication.py) at two addresses of this machine; every client
there -- a prefork ``celery worker`` (acks late) and a producer process publishing at a steady
rate -- has the libpq multi-host URL of both, ``target_session_attrs=read-write``. Mid-stream
the primary's address is black-holed (netfilter drops its packets where they arrive, both
ways), the primary is then stopped so it cannot come back, and the standby is promoted
(replication runs over 127.0.0.1, outside the black hole). What must hold:

* every publish that returned runs (0 lost: the standby was synchronous);
* every ``apply_async`` call returns or raises within a bound set by those timers;
* the worker runs tasks claimed on the new primary within a bound set by the same timers: the
  seconds from the black hole to the first such task are printed (``pytest -s``);
* once a connection found the new primary, the process's next connections go there first and
  never wait out ``connect_timeout`` on the dark address again (pgbroker._pg.driver).

With pgbroker's own defaults (30 s tcp_user_timeout, 10 s connect_timeout) the scenario takes
over a minute: ``-m slow``; the default tier lowers the timers in the URL and the transport
options, as an operator who wants a faster failover does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.chaos.hosts import Host, hosts, needs_iptables
from tests.chaos.app import sturdy_touch
from tests.chaos.load import CHAOS_TASKS, PUBLISH_RETRY, wait_all_completed
from tests.chaos.replication import Cluster, cluster
from tests.apps import e2e_app as e2e
from tests.support.workers import SHORT_LEASE, wait_state
from tests.support import processes as helpers
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import wait_for

pytestmark = needs_iptables

#: Tasks the producer sends, and how fast.
COUNT, RATE = 400, 50

#: Publishes returned before the black hole.
BEFORE = 100

#: Seconds between stopping the old primary and promoting the standby (an HA manager's
#: decision; clients meanwhile find the standby read-only).
DETECTION = 3.0


@dataclass(frozen=True)
class Timers:
    """The TCP and connection timers of every client on the host, in seconds; None: pgbroker's
    defaults (``pgbroker._pg.driver._KEEPALIVES``: tcp_user_timeout 30, keepalives 10 s + 5 s apart;
    ``Settings.connect_timeout`` 10)."""

    tcp_user_timeout: float | None = None
    keepalives_idle: float | None = None
    keepalives_interval: float | None = None
    connect_timeout: float | None = None

    def query(self) -> str:
        """The libpq parameters of the URL (pgbroker's defaults apply to what is not there)."""
        params = ["target_session_attrs=read-write"]
        if self.tcp_user_timeout is not None:
            params.append(f"tcp_user_timeout={int(self.tcp_user_timeout * 1000)}")
        for name in ("keepalives_idle", "keepalives_interval"):
            if getattr(self, name) is not None:
                params.append(f"{name}={int(getattr(self, name))}")
        return "&".join(params)

    def task_query(self) -> str:
        """The libpq parameters of the tasks' own connections (``public.runs``): the same, with
        pgbroker's defaults written out where they are unset -- libpq has none, and a task's
        INSERT into the black hole would otherwise wait ~15 minutes, holding its pool slot."""
        return Timers(*(30.0 if self.tcp_user_timeout is None else self.tcp_user_timeout,
                        10.0 if self.keepalives_idle is None else self.keepalives_idle,
                        5.0 if self.keepalives_interval is None else self.keepalives_interval)
                      ).query() + "&connect_timeout=" + f"{self.connect() - 1:.0f}"

    def options(self) -> dict[str, Any]:
        """The transport options: short leases, and ``connect_timeout`` if set."""
        extra = {} if self.connect_timeout is None else {"connect_timeout": self.connect_timeout}
        return {**SHORT_LEASE, **extra}

    def detect(self) -> float:
        """Seconds until the kernel gives a connection into the black hole up: unacknowledged
        data after tcp_user_timeout; an idle one at its first keepalive probe past that."""
        user = 30.0 if self.tcp_user_timeout is None else self.tcp_user_timeout
        idle = 10.0 if self.keepalives_idle is None else self.keepalives_idle
        interval = 5.0 if self.keepalives_interval is None else self.keepalives_interval
        return max(user, idle + interval) + interval

    def connect(self) -> float:
        """Seconds one connection attempt over the URL can take before the standby answers:
        the black-holed address is tried first and never answers."""
        return (10.0 if self.connect_timeout is None else self.connect_timeout) + 1.0


@dataclass
class Site:
    host: Host
    cluster: Cluster
    url: str      # the database, from this machine (127.0.0.1, both servers)
    remote: str   # the database, from the host (the two addresses)
    tmp: Path

    def broker_url(self) -> str:
        return "pgbroker+" + self.remote


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    """One host, the primary at its gateway, the standby at a second address beside it."""
    with hosts(1) as (host,):
        standby_address = host.add_gateway()
        net = host.gateway.rsplit(".", 2)[0]
        with cluster(synchronous=True,
                     listen=(f"127.0.0.1,{host.gateway}", f"127.0.0.1,{standby_address}"),
                     hba=[f"host all all {net}.0.0/16 trust"]) as made:
            name = made.create_database()
            url = made.url(name)
            remote = (f"postgresql://postgres@{host.gateway}:{made.primary.port},"
                      f"{standby_address}:{made.standby.port}/{name}")
            with psycopg.connect(url, autocommit=True) as pg:
                pg.execute(e2e.RUNS_DDL)
            made.wait_replayed()
            yield Site(host, made, url, remote, tmp_path)


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


class Producer:
    """``python -m tests.chaos.load`` on the host: its calls, read from its output as they come."""

    def __init__(self, site: Site, timers: Timers, prefix: str):
        self.out = site.tmp / f"{prefix}.jsonl"
        env = helpers._env(site.broker_url() + "?" + timers.query(), {
            "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(timers.options())})
        # Celery's publish retries, fewer than the load's default: a call that gives up is
        # sent again by the load itself (same task id), so its bound stays short
        retry = json.dumps({**PUBLISH_RETRY, "max_retries": 3})
        with open(self.out, "wb") as out:
            self.popen = subprocess.Popen(
                site.host.enter() + [sys.executable, "-m", "tests.chaos.load", prefix,
                                     str(COUNT), str(RATE), retry],
                cwd=helpers.REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def calls(self) -> list[dict[str, Any]]:
        lines = self.out.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def returned(self) -> list[dict[str, Any]]:
        return [c for c in self.calls() if c["error"] is None]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)


def _first_on_new_primary(pg: psycopg.Connection, promoted: float
                          ) -> tuple[datetime | None, datetime | None]:
    """The first claim after the promotion (so on the new primary), and the first run of a task
    claimed then (its record is the task's own write, over its own connection)."""
    return pg.execute(
        "SELECT min(j.locked_at), min(r.at) FROM pgbroker.jobs j LEFT JOIN public.runs r"
        " ON r.key = j.task_id AND r.at >= j.locked_at WHERE j.locked_at > %s",
        (_at(promoted),)).fetchone()


def _black_hole_failover(site: Site, timers: Timers, monkeypatch: pytest.MonkeyPatch) -> None:
    host, made = site.host, site.cluster
    # the tasks' own writes go over the same two addresses, with the same timers
    monkeypatch.setenv("PGBROKER_TEST_RUNS_URL", site.remote + "?" + timers.task_query())
    worker = host.start_worker(site.broker_url() + "?" + timers.query(), *CHAOS_TASKS,
                               "-c", "2", options=timers.options())
    producer = Producer(site, timers, "hole")
    try:
        wait_for(lambda: len(producer.returned()) >= BEFORE, 60, interval=0.05,
                 message=lambda: f"{BEFORE} publishes ({producer.out.read_text()[-2000:]})")
        host.black_hole(host.gateway)
        holed = time.time()  # (what was published while the rules went in may run twice)
        time.sleep(0.5)  # the primary, out of reach, still runs: then it is stopped for good
        _, promoted = made.fail_over(detection=DETECTION)

        # every call returns or raises within its bound: the statement in flight is given up
        # (detect), then each of Celery's 4 tries may connect (the dark address first) and wait
        # out its retry interval; 5 s for a loaded machine
        per_call = timers.detect() + 4 * (timers.connect() + PUBLISH_RETRY["interval_max"]) + 5
        left = COUNT / RATE + (promoted - holed) + 2 * per_call
        try:
            producer.popen.wait(max(0.0, holed + left - time.time()))
        except subprocess.TimeoutExpired:
            pass
        calls = producer.calls()
        longest = max(calls, key=lambda c: c["end"] - c["start"])
        assert producer.popen.poll() is not None, (
            f"the producer has not finished {left:.0f}s after the black hole: "
            f"{len(producer.returned())} of {COUNT} returned; last call {calls[-1]}")
        assert producer.popen.returncode == 0, producer.out.read_text()[-3000:]
        assert longest["end"] - longest["start"] <= per_call, longest
        sent = sorted({c["key"] for c in calls if c["error"] is None})
        assert len(sent) == COUNT

        with psycopg.connect(site.url, autocommit=True) as pg:
            result = wait_all_completed(pg, sent, 120)
            claimed, ran = _first_on_new_primary(pg, promoted)
            twice = {r[0] for r in pg.execute(
                "SELECT key FROM public.runs WHERE key = ANY(%s) GROUP BY key"
                " HAVING count(*) > 1", (sent,))}
    finally:
        producer.stop()
    assert result.lost == 0 and result.rows == result.sent
    # a task ran twice only if the worker held it at the black hole: -c 2, prefetch 1 (two
    # running, two acks not yet written), all published before it
    assert len(twice) <= 4 and twice <= {c["key"] for c in calls if c["end"] < holed}, twice
    assert claimed is not None and ran is not None
    resumed, first_run = claimed.timestamp() - holed, ran.timestamp() - holed
    # the worker's connections are given up (detect) -- or, sooner, the promotion is what it
    # waits for --; the lease connects again (the dark address first), the event loop waiting
    # behind it; then Celery connects the consumer again (the store, the LISTEN connection: to
    # the server that took the lease's), waiting 2 s, then 4 s, after an attempt that met the
    # standby before its promotion; 5 s for a loaded machine
    bound = max(timers.detect(), promoted - holed) + 2 * timers.connect() + 2 + 4 + 5
    assert resumed <= bound, (resumed, bound)
    # and that task's own write connects again too, the dark address first
    assert first_run <= bound + timers.connect(), (first_run, bound)
    assert worker.is_alive()
    errors = [c for c in calls if c["error"] is not None]
    print("\n" + result.line(
        f"black-holed primary, synchronous standby promoted ({timers.query()}, "
        f"connect_timeout {timers.connect() - 1:.0f}s)",
        f"first claim on the new primary {resumed:.1f}s after the black hole (bound "
        f"{bound:.0f}s; promotion at {promoted - holed:.1f}s), its task ran at {first_run:.1f}s; "
        f"longest apply_async "
        f"{longest['end'] - longest['start']:.1f}s (bound {per_call:.0f}s); {len(errors)} "
        f"publish error(s) reached the producer (sent again); {len(twice)} task(s) ran twice"))


#: Run on the host: two connections over the URL in argv[1], one after the other (the second
#: when a line comes on stdin); prints the server each reached, and how long it took.
_CONNECT_TWICE = """
import json, sys, time
from pgbroker._pg import driver as _db
for n in range(2):
    if n:
        sys.stdin.readline()
    started = time.monotonic()
    conn = _db.connect(sys.argv[1], connect_timeout=float(sys.argv[2]))
    print(json.dumps([conn.info.host, time.monotonic() - started]), flush=True)
    conn.close()
"""


def test_after_a_failover_only_the_first_connection_waits_for_the_dark_address(
        site: Site) -> None:
    """A worker that lost the old primary opens several connections again (its store, its
    LISTEN connection, each of Celery's reconnects): each one that tries the dark address first
    waits out ``connect_timeout`` there -- 10 s by default, three times in a row in the
    scenario below. Once one of them found the writable server, the process tries that one
    first (as pgjdbc's host status tracker does): the next never touches the dark address."""
    host, made = site.host, site.cluster
    host.black_hole(host.gateway)
    made.fail_over(detection=0)
    timeout = 2
    run = subprocess.Popen(
        host.enter() + [sys.executable, "-c", _CONNECT_TWICE,
                        site.remote + "?target_session_attrs=read-write", str(timeout)],
        cwd=helpers.REPO_ROOT, env=helpers._env(site.broker_url(), {}), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert run.stdout is not None and run.stdin is not None
        first = json.loads(run.stdout.readline() or "null")
        tried = host.dropped(host.gateway)
        run.stdin.write("\n")
        run.stdin.flush()
        second = json.loads(run.stdout.readline() or "null")
        again = host.dropped(host.gateway) - tried
        assert run.wait(30) == 0, run.stderr.read() if run.stderr else ""
    finally:
        if run.poll() is None:
            run.kill()
    standby = host.gateways[1]
    assert first is not None and first[0] == standby and first[1] >= timeout * 0.9, first
    assert tried > 0  # the first connection knocked at the dark address (and waited)
    assert second is not None and second[0] == standby, second
    assert again == 0, f"the second connection sent {again} packet(s) to the dark address"
    print(f"\n[figure] after a failover to a black-holed primary: the first connection took "
          f"{first[1]:.2f}s (connect_timeout {timeout}s on the dark address), the second "
          f"{second[1]:.3f}s")


def test_an_idle_worker_follows_its_shared_connection_to_the_new_primary(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle worker (nothing running, no claim in flight, its poll far off) has nothing in
    flight on its LISTEN connection when the primary goes dark: the kernel can only give that
    connection up after the keepalives (10 s + 5 s by default), however short
    ``tcp_user_timeout`` is. The lease's heartbeats, every ``heartbeat_interval`` on the
    process's shared connection, notice within ``tcp_user_timeout`` and connect that one to the
    new primary; the LISTEN connection, on another server now, must follow at once, not wait
    for its own timers."""
    host, made = site.host, site.cluster
    timers = Timers(tcp_user_timeout=2, connect_timeout=2)  # the keepalives: pgbroker's
    monkeypatch.setenv("PGBROKER_TEST_RUNS_URL", site.remote + "?" + timers.task_query())
    worker = host.start_worker(site.broker_url() + "?" + timers.query(), *CHAOS_TASKS,
                               "-c", "2", options={**timers.options(), "poll_interval": 60})
    point_producer(e2e.app, "pgbroker+" + site.url)  # from this machine, outside the hole
    try:
        sturdy_touch.apply_async(("idle-before",), task_id="idle-before")
        with psycopg.connect(site.url, autocommit=True) as pg:
            wait_state(pg, "idle-before", "completed")
        time.sleep(1)  # idle: the claim after that task's ack has come back
        host.black_hole(host.gateway)
        holed = time.time()
        made.fail_over(detection=DETECTION)
        drop_pools(e2e.app)  # (its connection was to the old primary)
        sturdy_touch.apply_async(("idle-after",), task_id="idle-after")
        with psycopg.connect(site.url, autocommit=True) as pg:
            wait_state(pg, "idle-after", "completed", timeout=60)
            claimed = pg.execute("SELECT locked_at FROM pgbroker.jobs WHERE task_id = %s",
                                 ("idle-after",)).fetchone()[0]
    finally:
        drop_pools(e2e.app)
    resumed = claimed.timestamp() - holed
    # the next heartbeat goes into the hole and is given up after tcp_user_timeout; the lease
    # connects again (the dark address first); Celery connects the consumer again at once
    # (its first retry 2 s later if that meets the standby before its promotion); 2 s slack
    heartbeat = float(SHORT_LEASE["heartbeat_interval"])
    bound = heartbeat + float(timers.tcp_user_timeout or 0) + timers.connect() + 2 + 2
    assert resumed <= bound, (
        f"the idle worker claimed on the new primary {resumed:.1f}s after the black hole "
        f"(bound {bound:.0f}s: its LISTEN connection waited for its keepalives?)")
    assert worker.is_alive()
    print(f"\n[figure] black-holed primary, idle worker (tcp_user_timeout "
          f"{timers.tcp_user_timeout}s, keepalives pgbroker's): first claim on the new "
          f"primary {resumed:.1f}s after the black hole (bound {bound:.0f}s)")


def test_blackholed_primary_with_short_timers(site: Site, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    _black_hole_failover(site, Timers(tcp_user_timeout=3, keepalives_idle=2,
                                      keepalives_interval=1, connect_timeout=2), monkeypatch)


@pytest.mark.slow
def test_blackholed_primary_with_pgbroker_defaults(site: Site,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with nothing lowered: what a user who sets nothing gets."""
    _black_hole_failover(site, Timers(), monkeypatch)
