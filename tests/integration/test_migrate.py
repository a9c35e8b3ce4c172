"""Schema migrations against real, brand-new databases: fresh install, re-run, concurrent first
start, a schema from a newer pgbroker, auto_migrate off, and two schemas side by side."""

from __future__ import annotations

import multiprocessing
from typing import Any

import psycopg
import pytest

from pgbroker.errors import ConfigurationError, SchemaError
from pgbroker.migrate import MIGRATIONS, check, latest_version, migrate
from tests.support.transport import Collector, connect, jobs, publish

ALL_VERSIONS = [m.version for m in MIGRATIONS]
#: What the refusal of a newer schema must say: which versions, and what to do.
NEWER = r"newer .*\[999\].* upgrade"


def applied(url: str, schema: str = "pgbroker") -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute(
            f'SELECT version FROM "{schema}".migrations ORDER BY version')]


def catalog(url: str, schema: str = "pgbroker") -> list[tuple[Any, ...]]:
    """Every relation and column of ``schema``: what a re-run must leave unchanged."""
    with psycopg.connect(url) as conn:
        return conn.execute("""
            SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod)
            FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
            LEFT JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0
            WHERE n.nspname = %s ORDER BY 1, 3""", (schema,)).fetchall()


def schema_exists(url: str, schema: str = "pgbroker") -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (schema,)).fetchone()
        return bool(row and row[0])


def test_fresh_install(empty_url: str) -> None:
    assert not schema_exists(empty_url)
    assert migrate(empty_url) == ALL_VERSIONS
    assert applied(empty_url) == ALL_VERSIONS
    names = {row[0] for row in catalog(empty_url)}
    assert {"jobs", "queues", "consumers", "migrations", "jobs_claim_idx"} <= names
    with psycopg.connect(empty_url) as conn:
        check(conn, "pgbroker")  # exactly this version: no error


def test_rerun_is_a_no_op(empty_url: str) -> None:
    migrate(empty_url)
    before = catalog(empty_url)
    with psycopg.connect(empty_url) as conn:
        applied_at = conn.execute("SELECT version, applied_at FROM pgbroker.migrations").fetchall()
    assert migrate(empty_url) == []
    assert migrate(empty_url) == []
    assert catalog(empty_url) == before
    with psycopg.connect(empty_url) as conn:
        assert conn.execute("SELECT version, applied_at FROM pgbroker.migrations").fetchall() \
            == applied_at


def _migrate_at_once(url: str, barrier: Any, results: Any) -> None:
    """One of several processes starting at the same moment (runs in a spawned child)."""
    try:
        barrier.wait(timeout=60)
        results.put(("ok", migrate(url)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_concurrent_first_start_of_six_processes(empty_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")  # no inherited connections or threads
    barrier = ctx.Barrier(6)
    results = ctx.Queue()
    procs = [ctx.Process(target=_migrate_at_once, args=(empty_url, barrier, results))
             for _ in range(6)]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert [kind for kind, _ in outcomes] == ["ok"] * 6, outcomes
    # every version applied by exactly one process, once
    assert sorted(v for _, versions in outcomes for v in versions) == ALL_VERSIONS
    assert applied(empty_url) == ALL_VERSIONS


def test_a_schema_from_a_newer_pgbroker_is_refused(db_url: str, broker_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO pgbroker.migrations (version, name) VALUES (999, 'future')")
        with pytest.raises(SchemaError, match=NEWER):
            check(conn, "pgbroker")
    with pytest.raises(SchemaError, match=NEWER):
        migrate(db_url)
    for auto_migrate in (True, False):
        with connect(broker_url, auto_migrate=auto_migrate) as conn:
            with pytest.raises(SchemaError, match=NEWER):
                conn.transport.establish_connection()
    assert applied(db_url) == ALL_VERSIONS + [999]  # nothing was downgraded or touched


def test_auto_migrate_off_and_no_schema_says_to_run_pgbroker_migrate(empty_url: str) -> None:
    with connect("pgbroker+" + empty_url, auto_migrate=False) as conn:
        with pytest.raises(SchemaError, match="run `pgbroker migrate`"):
            conn.connect()
    assert not schema_exists(empty_url)  # nothing created behind the operator's back


def test_auto_migrate_off_and_a_missing_migration_is_refused(db_url: str, broker_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgbroker.migrations WHERE version = %s", (latest_version(),))
    with connect(broker_url, auto_migrate=False) as conn:
        with pytest.raises(SchemaError, match=rf"lacks migrations \[{latest_version()}\]"):
            conn.connect()


def test_auto_migrate_on_first_connect(empty_url: str) -> None:
    with connect("pgbroker+" + empty_url) as conn:
        conn.connect()
        publish(conn, {"n": 1}, "first")
    assert applied(empty_url) == ALL_VERSIONS


@pytest.mark.parametrize("schema", ["Bad", 'x"; DROP SCHEMA pgbroker; --', ""])
def test_migrate_refuses_an_invalid_schema_name(db_url: str, schema: str) -> None:
    with pytest.raises(ConfigurationError, match="not a valid pgbroker schema name"):
        migrate(db_url, schema)
    assert applied(db_url) == ALL_VERSIONS


def test_a_second_schema_in_the_same_database_is_isolated(db_url: str, broker_url: str,
                                                          pg: psycopg.Connection) -> None:
    assert migrate(db_url, "other_app") == ALL_VERSIONS
    assert applied(db_url, "other_app") == ALL_VERSIONS
    with connect(broker_url, schema="other_app") as other, connect(broker_url) as default:
        publish(other, {"to": "other"}, "shared-name")
        publish(default, {"to": "default"}, "shared-name")
        assert [r["body"] for r in jobs(pg, schema="other_app")] == [b'{"to": "other"}']
        assert [r["body"] for r in jobs(pg)] == [b'{"to": "default"}']

        from_other = Collector(other, ["shared-name"], ack=True)
        from_default = Collector(default, ["shared-name"], ack=True)
        from_other.take(1)
        from_default.take(1)
        assert from_other.nothing_for(0.3) and from_default.nothing_for(0.3)
        assert (from_other.bodies, from_default.bodies) == ([{"to": "other"}], [{"to": "default"}])
        # each schema registers its own consumers and never sees the other's
        for schema in ("pgbroker", "other_app"):
            assert pg.execute(f'SELECT count(*) FROM "{schema}".consumers').fetchone() == (1,)
    assert migrate(db_url, "other_app") == []
