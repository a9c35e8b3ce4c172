"""Migration 0015's settings with autovacuum on, which the shared test server has off: a server of
this module's own (tests/support/throwaway.py), whose autovacuum looks every second.

A small hot table is vacuumed after 200 dead row versions whatever its size (PostgreSQL's
default waits for 50 + 20 % of its rows), and the sweeper's fallback leaves to autovacuum what
autovacuum looks after.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from pgbroker._pg import vacuum as _vacuum
from tests.support.throwaway import ThrowawayServer, throwaway_server
from tests.support.processes import wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[ThrowawayServer]:
    with throwaway_server(settings={"autovacuum_naptime": "1"}) as server:
        yield server


def autovacuums(pg: psycopg.Connection, table: str) -> int:
    return pg.execute("SELECT autovacuum_count FROM pg_stat_user_tables"
                      " WHERE schemaname = 'pgbroker' AND relname = %s", (table,)).fetchone()[0]


def test_a_small_hot_table_is_autovacuumed_after_200_dead_versions(
        server: ThrowawayServer) -> None:
    url = server.create_database()
    with psycopg.connect(url, autocommit=True) as pg:
        # 2,000 consumers: PostgreSQL's default would wait for 50 + 400 dead versions. Their
        # inserts alone start an autovacuum (1,000 + 20 %): not while they are written, and
        # counted only up to the VACUUM after them -- once their statistics have arrived (the
        # writing session sends them as it exits), or they would count again after it.
        pg.execute("ALTER TABLE pgbroker.consumers SET (autovacuum_enabled = false)")
        with psycopg.connect(url, autocommit=True) as writer:
            writer.execute("INSERT INTO pgbroker.consumers (id, host, pid, queues) SELECT"
                           " gen_random_uuid(), 'h', g, '{q}' FROM generate_series(1, 2000) g")
        wait_for(lambda: pg.execute(
            "SELECT n_ins_since_vacuum FROM pg_stat_user_tables"
            " WHERE schemaname = 'pgbroker' AND relname = 'consumers'").fetchone()[0] >= 2000, 30)
        pg.execute("VACUUM ANALYZE pgbroker.consumers")
        pg.execute("ALTER TABLE pgbroker.consumers RESET (autovacuum_enabled)")
        before = autovacuums(pg, "consumers")
        # 300 dead versions that only VACUUM cleans after (the key changes: no HOT update)
        pg.execute("UPDATE pgbroker.consumers SET id = gen_random_uuid() WHERE pid <= 300")
        [consumers] = [t for t in _vacuum.tables(pg, "pgbroker") if t.table == "consumers"]
        assert consumers.autovacuum and not consumers.due  # the fallback stays out of it
        wait_for(lambda: autovacuums(pg, "consumers") > before, 60,
                 message="an autovacuum of consumers after 300 dead versions")
    server.drop_database(url)
