"""VACUUM's side of the queue, against the real server (issue 26): who holds back its horizon
(a held transaction id, a REPEATABLE READ snapshot) as ``pgbroker stats``, ``pgbroker health
vacuum``, ``/metrics`` and the admin page show it, a role without pg_read_all_stats, the
worker's WARNING, migration 0015's settings, and the sweeper's VACUUM when autovacuum is off
(it is off on the shared test server).

The server is shared: other sessions (other tests, other databases) may hold the horizon too,
so each test looks for its own holder among those shown, by pid and application name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pgbroker._pg import vacuum as _vacuum
from pgbroker._consume.lease import Lease
from pgbroker._pg.store import Store
from pgbroker.metrics import MetricsReader, prometheus_registry
from pgbroker.sweeper import Sweeper
from tests.support.transport import store_for
from tests.support.db import db_now
from tests.support.processes import Run, wait_for

APP = "report-left-open"


@pytest.fixture(params=["transaction", "snapshot"])
def holder(request: pytest.FixtureRequest, db_url: str) -> Iterator[psycopg.Connection]:
    """A session holding back the horizon: ``BEGIN; SELECT txid_current();`` (kind
    'transaction'), or a REPEATABLE READ transaction that has read a table (kind 'snapshot');
    ``conn.kind`` says which."""
    conn = psycopg.connect(db_url, application_name=APP)
    if request.param == "transaction":
        conn.execute("SELECT txid_current()")
    else:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT count(*) FROM pgbroker.jobs")
    conn.kind = request.param  # type: ignore[attr-defined]
    yield conn
    conn.close()


def mine(holders: list[dict[str, Any]], conn: psycopg.Connection) -> dict[str, Any]:
    """The holder that is ``conn``'s session."""
    found = [h for h in holders if h["pid"] == conn.info.backend_pid]
    assert len(found) == 1, holders
    return found[0]


def test_stats_and_health_show_the_holder(holder: psycopg.Connection, cli: Run) -> None:
    code, out, _ = cli("stats", "--json")
    assert code == 0
    report = json.loads(out)["vacuum"]
    h = mine(report["holders"], holder)
    assert (h["kind"], h["name"], h["state"]) == (holder.kind, APP, "idle in transaction")
    assert h["query"].startswith("SELECT") and h["age"] > 0 and not h["hidden"]
    assert report["horizon_age_seconds"] >= h["age"]
    assert [t["table"] for t in report["tables"]] == list(_vacuum.HOT_TABLES)

    code, out, _ = cli("stats")
    line = next(x for x in out.splitlines() if f"pid {holder.info.backend_pid} " in x)
    assert holder.kind in line and APP in line and "idle in transaction" in line

    code, out, _ = cli("health", "vacuum", "--max-age", "0")
    verdict = json.loads(out)
    assert (code, verdict["status"]) == (3, "stale")
    assert mine(verdict["holders"], holder)["name"] == APP
    holder.rollback()  # released: nothing of this session is left to show
    code, out, _ = cli("health", "vacuum", "--max-age", "0")
    assert all(h["pid"] != holder.info.backend_pid for h in json.loads(out)["holders"])


def test_metrics_show_the_holder(holder: psycopg.Connection, pg: psycopg.Connection) -> None:
    reader = MetricsReader()
    text = generate_latest(prometheus_registry(lambda: reader.snapshot(pg))).decode()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples
               if not s.labels}
    assert samples["pgbroker_xmin_horizon_age_seconds"].value > 0
    assert samples["pgbroker_xmin_horizon_age_xids"].value >= 0
    held = [s for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "pgbroker_xmin_horizon_holder_age_xids"
            and s.labels["pid"] == str(holder.info.backend_pid)]
    assert [(s.labels["kind"], s.labels["application_name"], s.labels["state"]) for s in held] \
        == [(holder.kind, APP, "idle in transaction")]
    tables = {s.labels["table"]: s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "pgbroker_table_dead_tuples"}
    assert set(tables) == set(_vacuum.HOT_TABLES)
    assert 'pgbroker_table_autovacuum{table="jobs_live"} 0.0' in text  # off on the test server


def test_the_admin_page_shows_the_holder(db_url: str, client: FlaskClient) -> None:
    conn = psycopg.connect(db_url, application_name=APP)
    pid = conn.info.backend_pid
    try:
        conn.execute("SELECT txid_current()")
        page = client.get("/overview/live").text
        assert f'<tr data-pid="{pid}"><td>transaction</td>' in page
        assert f"<td>{APP}</td>" in page and "SELECT txid_current()" in page
        assert '<tr data-table="consumers">' in page
    finally:
        conn.close()
    wait_for(lambda: f'data-pid="{pid}"' not in client.get("/overview/live").text, 10)


def test_a_role_without_pg_read_all_stats_sees_pid_application_and_age_in_xids(
        database_url: str, db_url: str) -> None:
    role = f"pgbroker_nostats_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    held = psycopg.connect(db_url, application_name=APP)  # a superuser's session
    try:
        held.execute("SELECT txid_current()")
        with psycopg.connect(db_url, user=role, autocommit=True) as conn:
            [h] = [h for h in _vacuum.holders(conn, "pgbroker", limit=50)
                   if h.pid == held.info.backend_pid]
        assert (h.kind, h.name, h.hidden, h.state, h.age) == ("transaction", APP, True, None,
                                                              None)
        assert h.xid_age >= 0 and "grant pg_read_all_stats" in h.describe()
    finally:
        held.close()
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'DROP ROLE "{role}"')


def test_a_transaction_id_held_in_another_database_is_shown_with_its_database(
        database_url: str, pg: psycopg.Connection) -> None:
    """Every new snapshot counts a running transaction id of any database as running: it holds
    this database's horizon too. A snapshot alone in another database does not."""
    other = psycopg.connect(database_url, application_name=APP)
    try:
        other.execute("SELECT 1")  # a snapshot only (READ COMMITTED: none between statements)
        assert all(h.pid != other.info.backend_pid for h in _vacuum.holders(pg, "pgbroker",
                                                                             limit=50))
        other.execute("SELECT txid_current()")
        [h] = [h for h in _vacuum.holders(pg, "pgbroker", limit=50)
               if h.pid == other.info.backend_pid]
        name = other.info.dbname
        assert (h.kind, h.name, h.database) == ("transaction", APP, name)
        assert f", in database {name}" in h.describe()
    finally:
        other.close()


def warnings_of(caplog: pytest.LogCaptureFixture, pid: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pgbroker._pg.vacuum"
            and r.levelno == logging.WARNING and f"pid {pid} " in r.getMessage()]


def test_the_worker_warns_once_per_holder_held_too_long(
        store: Store, pg: psycopg.Connection, db_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "pgbroker._pg.vacuum")
    conn = psycopg.connect(db_url, application_name=APP)
    try:
        conn.execute("SELECT txid_current()")
        pid = conn.info.backend_pid
        sweeper = Sweeper(store)
        sweeper.run_once()
        assert warnings_of(caplog, pid) == []  # held for less than xmin_warn_after (300 s)
        later = db_now(pg) + timedelta(seconds=store.settings.xmin_warn_after + 1)
        sweeper.run_once(now=later)
        [message] = warnings_of(caplog, pid)
        for words in (f"pid {pid} '{APP}'", "idle in transaction", "SELECT txid_current()",
                      "transactions old", f"pg_terminate_backend({pid})",
                      "idle_in_transaction_session_timeout"):
            assert words in message
        sweeper.run_once(now=later + timedelta(seconds=60))
        assert len(warnings_of(caplog, pid)) == 1  # once per holder, not at every pass

        # a tiny threshold on the real clock: warned as soon as it is held that long
        tiny = _vacuum.HorizonGuard(dataclasses.replace(store.settings, xmin_warn_after=0.01))
        wait_for(lambda: any(h.pid == pid for h in tiny.check(store.conn)), 10)
        off = _vacuum.HorizonGuard(dataclasses.replace(store.settings, xmin_warn_after=0))
        assert off.check(store.conn, now=later) == []  # 0: never
    finally:
        conn.close()


def test_a_workers_lease_warns_and_a_remote_control_clients_does_not(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """``celery inspect`` consumes a reply queue, and sweeps while it waits for replies: its
    stderr is the user's terminal, told nothing at every call."""
    caplog.set_level(logging.WARNING, "pgbroker._pg.vacuum")
    store = store_for(db_url, sweep_interval=0.1, heartbeat_interval=0.1, lease_timeout=2,
                      xmin_warn_after=0.01)
    conn = psycopg.connect(db_url, application_name=APP)
    leases = [Lease(store, lambda q=q: [q]) for q in ("x.reply.celery.pidbox", "celery")]
    swept = [0, 0]
    for i, lease in enumerate(leases):
        run_once = lease._sweeper.run_once

        def counted(*args: Any, _i: int = i, _run: Any = run_once, **kw: Any) -> Any:
            swept[_i] += 1
            return _run(*args, **kw)
        lease._sweeper.run_once = counted  # type: ignore[method-assign]
    try:
        conn.execute("SELECT txid_current()")
        for lease in leases:
            lease.ensure()
        wait_for(lambda: warnings_of(caplog, conn.info.backend_pid) and min(swept) >= 3, 30,
                 message=lambda: f"a warning, and 3 sweeps of each lease (swept: {swept})")
        assert len(warnings_of(caplog, conn.info.backend_pid)) == 1  # the worker's, once
        assert not leases[0]._sweeper.horizon.enabled and not leases[0]._sweeper.vacuum.enabled
    finally:
        for lease in leases:
            lease.close()
        conn.close()
        store.close()


def test_migration_0015_sets_the_hot_tables_autovacuum(pg: psycopg.Connection) -> None:
    options = dict(pg.execute(
        "SELECT c.relname, c.reloptions FROM pg_class AS c"
        " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'pgbroker' AND c.relname = ANY(%s)",
        (list(_vacuum.HOT_TABLES),)).fetchall())
    assert set(options) == set(_vacuum.HOT_TABLES)
    assert {"autovacuum_vacuum_scale_factor=0.01", "autovacuum_vacuum_threshold=1000",
            "autovacuum_vacuum_insert_scale_factor=0.01",
            "autovacuum_vacuum_cost_limit=2000", "fillfactor=90"} <= set(options["jobs_live"])
    # the finished jobs (0020): the same autovacuum, written once (no fillfactor)
    assert {"autovacuum_vacuum_scale_factor=0.01", "autovacuum_vacuum_threshold=1000",
            "autovacuum_vacuum_insert_scale_factor=0.01"} <= set(options["jobs_done"])
    assert not any(o.startswith("fillfactor") for o in options["jobs_done"])
    # never the ACCESS EXCLUSIVE lock of a VACUUM giving the table's end back (0020)
    assert "vacuum_truncate=false" in options["jobs_live"]
    assert "vacuum_truncate=false" in options["jobs_done"]
    for table in _vacuum.HOT_TABLES[2:]:
        assert {"autovacuum_vacuum_scale_factor=0", "autovacuum_vacuum_threshold=200",
                "autovacuum_vacuum_cost_delay=0"} <= set(options[table]), table


def dead(pg: psycopg.Connection, table: str) -> tuple[int, Any]:
    """(dead row versions, last vacuum) of ``table``, as the statistics have them now."""
    return pg.execute("SELECT n_dead_tup, last_vacuum FROM pg_stat_user_tables"
                      " WHERE schemaname = 'pgbroker' AND relname = %s", (table,)).fetchone()


def churn(pg: psycopg.Connection) -> None:
    """What a busy queue leaves with nobody vacuuming: 1,200 dead versions in jobs (600 jobs,
    claimed and acked), 250 in queues and consumers. (Their heartbeats are HOT updates, which
    a page prunes by itself while the horizon allows: these change the key, which only VACUUM
    can clean after.)"""
    pg.execute("INSERT INTO pgbroker.queues (name) VALUES ('busy')")
    pg.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues)"
               " VALUES (gen_random_uuid(), 'h', 1, '{busy}')")
    pg.execute("INSERT INTO pgbroker.jobs (id, queue, body)"
               " SELECT gen_random_uuid(), 'busy', '\\x' FROM generate_series(1, 600)")
    for state in ("running", "completed"):
        pg.execute("UPDATE pgbroker.jobs SET state = %s, locked_by = gen_random_uuid()",
                   (state,))
    for _ in range(250):
        pg.execute("UPDATE pgbroker.queues SET name = CASE name WHEN 'busy' THEN 'busy2'"
                   " ELSE 'busy' END")
        pg.execute("UPDATE pgbroker.consumers SET id = gen_random_uuid()")
    # the statistics arrive when the session is idle, at most once a second
    wait_for(lambda: all(dead(pg, t)[0] >= n for t, n in
                         (("jobs_live", 1200), ("queues", 250), ("consumers", 250))), 15,
             message=lambda: str([dead(pg, t) for t in ("jobs_live", "queues", "consumers")]))


def test_with_autovacuum_off_the_sweeper_vacuums_the_hot_tables(
        store: Store, pg: psycopg.Connection) -> None:
    churn(pg)
    assert [t.table for t in _vacuum.tables(pg, "pgbroker") if t.due] == [
        "jobs_live", "consumers", "queues"]
    sweeper = Sweeper(store)
    assert sweeper.run_once().vacuumed == 3
    sweeper.vacuum.wait(60)
    for table in ("jobs_live", "consumers", "queues"):
        wait_for(lambda t=table: dead(pg, t)[1] is not None, 15, message=f"{table} vacuumed")
        assert dead(pg, table)[0] < 50
    assert sweeper.run_once().vacuumed == 0  # nothing due, and at most every 15 s anyway
    assert dead(pg, "rate_limits")[1] is None  # not due: left alone


def test_the_fallback_never_waits_for_a_lock(store: Store, pg: psycopg.Connection,
                                             db_url: str) -> None:
    churn(pg)
    due = [t for t in _vacuum.tables(pg, "pgbroker") if t.due]
    locker = psycopg.connect(db_url)
    try:  # what a VACUUM, CREATE INDEX CONCURRENTLY or ANALYZE of queues holds
        locker.execute("LOCK TABLE pgbroker.queues IN SHARE UPDATE EXCLUSIVE MODE")
        fallback = _vacuum.VacuumFallback(db_url, store.settings, background=False)
        assert fallback.vacuum(due) == 2  # jobs and consumers; queues skipped at once
    finally:
        locker.close()
    assert dead(pg, "queues")[1] is None
    assert dead(pg, "consumers")[1] is not None
