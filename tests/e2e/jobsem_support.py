"""Fixtures of the issue-22 tests that run ``tests.e2e.jobsem_app`` in real workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from tests.e2e import jobsem_app
from tests.support.workers import SHORT_LEASE, start_worker
from tests.support.processes import WorkerProcess
from tests.support.producers import drop_pools, point_producer

__all__ = ["producer", "worker"]


def _options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The test module's transport options (``OPTIONS``), else short leases."""
    return getattr(request.module, "OPTIONS", SHORT_LEASE)


@pytest.fixture
def producer(broker_url: str, pg: psycopg.Connection,
             request: pytest.FixtureRequest) -> Iterator[Celery]:
    """``jobsem_app.app`` publishing into this test's database, its tables created."""
    pg.execute(jobsem_app.DDL)
    point_producer(jobsem_app.app, broker_url, _options(request))
    try:
        yield jobsem_app.app
    finally:
        drop_pools(jobsem_app.app)


def worker(broker_url: str, options: dict[str, Any], *args: str) -> WorkerProcess:
    """A ready ``celery worker`` of ``jobsem_app`` (``-c 2`` unless ``args`` says otherwise)."""
    return start_worker(broker_url, *args, options=options, app="tests.e2e.jobsem_app")
