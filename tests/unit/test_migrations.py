"""pgbroker's migrations as files: numbered 1 to n, with no gap (applying them:
tests/integration/test_migrate.py)."""

from __future__ import annotations

from pgbroker.migrate import MIGRATIONS, latest_version

ALL_VERSIONS = [m.version for m in MIGRATIONS]


def test_migrations_are_numbered_one_to_n() -> None:
    assert ALL_VERSIONS == list(range(1, latest_version() + 1))
