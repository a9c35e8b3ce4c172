"""Pointing a Celery app (the e2e app, ticketflow's) at this test's database, and forgetting its
connections afterwards, so no connection to an earlier test's (dropped) database is reused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from kombu import pools

__all__ = ["drop_pools", "point_producer"]


def point_producer(app: Celery, broker_url: str, options: Mapping[str, Any] | None = None) -> None:
    """Make ``app`` publish to ``broker_url`` with these transport options, from now on."""
    drop_pools(app)
    app.conf.broker_url = broker_url
    app.conf.broker_transport_options = dict(options or {})


def drop_pools(app: Celery) -> None:
    """Close ``app``'s connection and producer pools (and kombu's global ones)."""
    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None
    pools.reset()  # kombu's global producer pools are keyed by connection: forget them too
