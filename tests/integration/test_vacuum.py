"""VACUUM's side of the queue, against the real server (issue 26): migration 0015's autovacuum
settings of the hot tables.
"""

from __future__ import annotations

import psycopg

HOT_TABLES = ("jobs", "consumers", "queues", "concurrency_keys", "rate_limits", "broadcasts",
              "task_losses")


def test_migration_0015_sets_the_hot_tables_autovacuum(pg: psycopg.Connection) -> None:
    options = dict(pg.execute(
        "SELECT c.relname, c.reloptions FROM pg_class AS c"
        " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'pgbroker' AND c.relname = ANY(%s)",
        (list(HOT_TABLES),)).fetchall())
    assert set(options) == set(HOT_TABLES)
    assert {"autovacuum_vacuum_scale_factor=0.01", "autovacuum_vacuum_threshold=1000",
            "autovacuum_vacuum_insert_scale_factor=0.01",
            "autovacuum_vacuum_cost_limit=2000", "fillfactor=90"} <= set(options["jobs"])
    for table in HOT_TABLES[1:]:
        assert {"autovacuum_vacuum_scale_factor=0", "autovacuum_vacuum_threshold=200",
                "autovacuum_vacuum_cost_delay=0"} <= set(options[table]), table
