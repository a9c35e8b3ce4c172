"""Fixtures of every chaos test module: a PostgreSQL server of the module's own for the
scenarios that stop, crash or cut off the server (tests/support/throwaway.py). The
end-to-end producer and ``public.runs`` come from tests/support/fixtures.py, as for every tier.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.throwaway import ThrowawayServer, throwaway_server


@pytest.fixture(scope="module")
def own_server() -> Iterator[ThrowawayServer]:
    """A PostgreSQL server of this test module's own (see the module docstring)."""
    with throwaway_server() as server:
        yield server


@pytest.fixture
def own_db(own_server: ThrowawayServer) -> Iterator[str]:
    """URL (postgresql://) of a fresh, migrated database on :func:`own_server`."""
    url = own_server.create_database()
    try:
        yield url
    finally:
        own_server.drop_database(url)
