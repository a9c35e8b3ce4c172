"""Django's test runner, for projects whose tests publish to pgbroker.

``TEST_RUNNER = "pgbroker.contrib.django.testing.DiscoverRunner"``: Django's own runner, but
before it drops a test database it ends the sessions still connected to it -- the broker
connection the test process keeps for its publishes (shared by its threads, open until the
process ends), a worker a test left running -- as ``DROP DATABASE ... WITH (FORCE)`` would.
Without it, ``manage.py test`` ends with "database ... is being accessed by other users" once a
test published through the broker's own connection. The helpers to see and run what tests
enqueue are :mod:`pgbroker.testing`.
"""

from __future__ import annotations

from typing import Any

from django.db import connections
from django.test.runner import DiscoverRunner as DjangoDiscoverRunner

__all__ = ["DiscoverRunner", "end_other_sessions"]


def end_other_sessions(alias: str) -> int:
    """End every other session on Django database ``alias``'s database; how many."""
    db = connections[alias]
    if db.vendor != "postgresql":
        return 0
    with db.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return int(cursor.fetchone()[0])


class DiscoverRunner(DjangoDiscoverRunner):
    """Django's ``DiscoverRunner``; see the module docstring."""

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        for db, _name, destroy in old_config:
            if destroy and not self.keepdb:
                end_other_sessions(db.alias)
        super().teardown_databases(old_config, **kwargs)
