"""The Prometheus metrics when the database cannot be read (the figures on a real database:
tests/integration/test_metrics.py)."""

from __future__ import annotations

from prometheus_client import generate_latest

from pgbroker.errors import DatabaseUnavailable
from pgbroker.metrics import Snapshot, prometheus_registry


def test_unreachable_database_is_pgbroker_up_0() -> None:
    def broken() -> Snapshot:
        raise DatabaseUnavailable("cannot connect")

    text = generate_latest(prometheus_registry(broken)).decode()
    assert "pgbroker_up 0.0" in text
    assert "pgbroker_jobs{" not in text
