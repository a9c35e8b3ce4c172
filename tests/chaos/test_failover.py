"""A primary failover: the primary crashes (``pg_ctl stop -m immediate``) and its streaming
standby is promoted (``pg_ctl promote``), under load, while producers, a worker, beat, the result
backend and the admin page hold connections to it.

Every client is given the libpq multi-host URL of :meth:`tests.chaos.replication.Cluster.url`
(both servers, ``target_session_attrs=read-write``, ``connect_timeout=3``), as behind Patroni
or a cloud service's failover. What must hold:

* with a **synchronous** standby, every publish that returned runs (0 lost); a task runs twice
  only if it was in flight at the crash; the first task runs on the new primary within seconds of
  the promotion (printed, not asserted);
* with an **asynchronous** standby, the publishes committed on the old primary and not yet
  streamed are lost with it: the window is measured and printed;
* beat, the result backend and the admin page work on the new primary without a restart.

Real servers built with ``initdb``/``pg_basebackup`` (skipped without the binaries), real
``celery worker``/``beat`` processes; counts from SQL on the new primary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timezone

import psycopg
import pytest
from celery import Celery

from pgbroker.admin import create_app
from pgbroker.admin.auth import Credentials
from tests.chaos.load import CHAOS_TASKS, LoadProducer, wait_all_completed
from tests.chaos.replication import Cluster, cluster
from tests.apps import e2e_app as e2e
from tests.apps.beat_app import TICK
from tests.support.workers import SHORT_LEASE, start_worker
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import run_beat, wait_for


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


@pytest.fixture
def replicated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[Cluster, str, str]]:
    """(the cluster, a migrated database's multi-host URL, its broker URL) with ``public.runs``
    and the e2e producer pointed at it. The test's indirect parameter: ``(synchronous, form)``
    (:meth:`Cluster.broker_url`)."""
    synchronous, form = request.param
    with cluster(synchronous=synchronous) as made:
        name = made.create_database()
        url, broker = made.url(name), made.broker_url(name, form)
        monkeypatch.setenv("PGBROKER_TEST_RUNS_URL", url)  # the workers' tasks write there
        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute(e2e.RUNS_DDL)
        made.wait_replayed()
        point_producer(e2e.app, broker)
        try:
            yield made, url, broker
        finally:
            drop_pools(e2e.app)


def _count(url: str, keys: list[str]) -> int:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as pg:
        return pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE task_id = ANY(%s)",
                          (keys,)).fetchone()[0]


@pytest.mark.parametrize("replicated", [
    (True, "netloc"),
    (True, "query"),
    (True, "alternates"),
], ids=["hosts-in-netloc", "hosts-in-query", "kombu-alternates"], indirect=True)
def test_failover_with_a_synchronous_standby_loses_no_published_task(
        replicated: tuple[Cluster, str, str]) -> None:
    made, url, broker = replicated
    worker = start_worker(broker, *CHAOS_TASKS, "-c", "2", options=SHORT_LEASE)
    load = LoadProducer("sync", 600, rate=100).start()
    wait_for(lambda: len(load.sent) >= 200, 60, interval=0.05, message="200 publishes")
    crashed, promoted = made.fail_over()
    in_flight = set(load.sent)  # published before the promotion (some before the crash)
    try:
        load.join(90)  # never a hang: the producer's publishes come back
        with psycopg.connect(url, autocommit=True) as pg:
            result = wait_all_completed(pg, load.sent, 120)
            first = pg.execute("SELECT min(at) FROM public.runs WHERE at > %s",
                               (_at(promoted),)).fetchone()[0]
            twice = pg.execute(
                "SELECT key, min(at) FROM public.runs WHERE key = ANY(%s) GROUP BY key"
                " HAVING count(*) > 1", (load.sent,)).fetchall()
    finally:
        load.stop()
    assert result.lost == 0 and result.rows == result.sent
    # a task ran twice only if it was published (and so possibly running) before the failover
    assert {key for key, _ in twice} <= in_flight, twice
    assert len(twice) <= 4  # -c 2, prefetch 1: two running, two acks not yet written
    assert worker.is_alive()
    print("\n" + result.line(
        "failover, synchronous standby (primary -m immediate, standby promoted)",
        f"{len(in_flight)} published before the promotion; crash to promotion "
        f"{promoted - crashed:.2f}s; "
        f"first task run {(first - _at(promoted)).total_seconds():.2f}s after the promotion; "
        f"{len(load.errors)} publish error(s) reached the producer (sent again)"))


@pytest.mark.parametrize("replicated", [(False, "query")], ids=["async"], indirect=True)
def test_failover_with_an_asynchronous_standby_loss_window(
        replicated: tuple[Cluster, str, str]) -> None:
    """What an asynchronous standby loses: the publishes that returned on the old primary and
    are not on the promoted one (measured, printed); everything published after runs."""
    made, url, broker = replicated
    worker = start_worker(broker, *CHAOS_TASKS, "-c", "2", options=SHORT_LEASE)
    load = LoadProducer("async", 600, rate=100).start()
    wait_for(lambda: len(load.sent) >= 200, 60, interval=0.05, message="200 publishes")
    before = list(load.sent)  # these returned before the crash began
    with psycopg.connect(made.primary.url(), autocommit=True) as pg:
        lag = pg.execute("SELECT pg_current_wal_lsn() - replay_lsn, replay_lag FROM "
                         "pg_stat_replication").fetchone()
    crashed, promoted = made.fail_over()
    lost_at_failover = len(before) - _count(url, before)
    print(f"\n[figure] failover, asynchronous standby: {len(before)} publishes returned before "
          f"the crash, {lost_at_failover} of them not on the promoted standby (the loss window; "
          f"the standby's replay was {lag[0]} bytes / {lag[1]} behind just before the crash)")
    try:
        load.join(90)
        after = load.sent[len(before):]
        with psycopg.connect(url, autocommit=True) as pg:
            result = wait_all_completed(pg, after, 120)
    finally:
        load.stop()
    assert result.lost == 0
    assert worker.is_alive()
    print(result.line("failover, asynchronous standby: the publishes after the crash",
                      f"promotion took {promoted - crashed:.2f}s"))


def _occurrences(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as pg:
        return [r[0] for r in pg.execute(
            "SELECT headers->>'pgbroker_occurrence' FROM pgbroker.jobs WHERE task = %s",
            (TICK,))]


@pytest.mark.parametrize("replicated", [(True, "query")], ids=["sync"], indirect=True)
def test_beat_result_backend_and_admin_reconnect_after_failover(
        replicated: tuple[Cluster, str, str]) -> None:
    made, url, broker = replicated
    beat = run_beat("tests.apps.beat_app", broker, env={
        "PGBROKER_TEST_BEAT_OPTIONS": json.dumps({"overlap": "allow", "queue": "beat"})})
    results = Celery("failover-results", broker=broker, backend=broker, set_as_current=False)
    token = "failover-token-0123"
    admin = create_app(url, credentials=Credentials(token=token), refresh=1)
    client = admin.test_client()
    auth = {"Authorization": f"Bearer {token}"}
    try:
        wait_for(lambda: _occurrences(url), 60, interval=0.2, message="beat's first occurrence")
        results.backend.store_result("before-failover", 1, "SUCCESS")
        assert client.get("/metrics", headers=auth).status_code == 200
        _, promoted = made.fail_over()

        wait_for(lambda: any(o > _at(promoted).isoformat() for o in _occurrences(url)), 60,
                 interval=0.5, message="a beat occurrence on the new primary")
        stored = wait_for(lambda: _retry(lambda: results.backend.store_result(
            "after-failover", 2, "SUCCESS") or True), 30, interval=0.5,
            message="the result backend to store a result on the new primary")
        assert stored and results.AsyncResult("after-failover").get(timeout=10) == 2
        page = wait_for(lambda: _retry(lambda: client.get("/metrics", headers=auth).status_code
                                       == 200), 30, interval=0.5,
                        message="the admin page to answer from the new primary")
        assert page
    finally:
        beat.stop()
        admin.extensions["pgbroker"].close()
        results.close()
    occurrences = _occurrences(url)
    assert len(occurrences) == len(set(occurrences)), "beat fired an occurrence twice"
    print(f"\n[figure] failover: beat, result backend and admin page all answered on the new "
          f"primary; {len(occurrences)} beat occurrences, none twice")


def _retry(call):  # a predicate for wait_for that may raise meanwhile
    try:
        return call()
    except Exception:  # noqa: BLE001 - not reconnected yet: try again
        return False

