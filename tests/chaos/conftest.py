"""Fixtures of every chaos test module: the end-to-end producer and ``public.runs`` (from
tests/e2e/support.py), and a PostgreSQL server of the module's own for the scenarios that stop,
crash or cut off the server (tests/chaos/pgserver_fixture.py)."""

from tests.chaos.pgserver_fixture import own_db, own_server  # noqa: F401 - fixtures
from tests.e2e.support import producer, runs  # noqa: F401 - fixtures
