"""Database and process fixtures shared by every test directory.

Database layout of a test session (procrastinate's and psycopg's pattern):

* ``database_url`` — the server found by :func:`pgbroker._pg.local_server.resolve_database_url`
  (``PGBROKER_DATABASE_URL``, else the local server on 127.0.0.1:5432, else an embedded one).
* ``template_db`` — one database per session, migrated once with ``pgbroker.migrate.migrate``.
* ``db_url`` — a fresh copy of the template for each test (``CREATE DATABASE ... TEMPLATE``), so a
  test may commit, crash workers or drop tables without affecting any other test.

Workers and beats started through ``tests.support.processes`` are killed at the end of the test
that started them, whether it passed or not (``_stop_celery_processes`` below).

Each tier has a ``conftest.py`` of its own for its own fixtures (tests/integration, tests/chaos,
tests/kombu_suite); the fixtures several tiers use are in tests/support/fixtures.py, loaded here
as a plugin; helpers every tier uses are in the tests/support package, and the applications
several tiers run (Celery apps, the Django project) in tests/apps. A tier imports no other tier
(tests/unit/test_test_tiers.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pgbroker._pg.local_server import admin_url, resolve_database_url
from tests.support.databases import create_database, drop_database
from tests.support import processes

#: What runs in one process, one test after another, under pytest-xdist: the chaos tests start
#: servers, cut networks and stop PostgreSQL, and each measures what a fault costs, so two at
#: once would measure each other; the packaging tests build in the source tree (the sdist step
#: writes pgbroker.egg-info there), once for the module.
SERIAL = ("tests/chaos/", "tests/integration/test_packaging.py")

#: The fixtures several tiers share (runs, producer, ticketflow's): no test module imports one.
pytest_plugins = ("tests.support.fixtures",)

_counter = itertools.count(1)


@pytest.fixture(scope="session")
def database_url() -> str:
    """URL (postgresql://) of the server's maintenance database used to create test databases."""
    return resolve_database_url("tests")


@pytest.fixture(scope="session")
def template_db(database_url: str) -> Iterator[str]:
    """Name of a migrated database, created once per session and dropped at its end."""
    name = f"pgbroker_test_template_{os.getpid()}"
    drop_database(database_url, name)  # a leftover from a killed run with the same pid
    create_database(database_url, name)
    try:
        from pgbroker.migrate import migrate  # lazy: conftest must load without the module

        migrate(admin_url(database_url, name))
        yield name
    finally:
        drop_database(database_url, name)


@pytest.fixture
def db_url(database_url: str, template_db: str) -> Iterator[str]:
    """URL (postgresql://) of a fresh, migrated database for this test only."""
    name = f"pgbroker_test_{os.getpid()}_{next(_counter)}"
    create_database(database_url, name, template=template_db)
    try:
        yield admin_url(database_url, name)
    finally:
        drop_database(database_url, name)


@pytest.fixture
def empty_url(database_url: str) -> Iterator[str]:
    """URL (postgresql://) of a brand-new database with no pgbroker schema at all."""
    name = f"pgbroker_test_empty_{os.getpid()}_{next(_counter)}"
    create_database(database_url, name)
    try:
        yield admin_url(database_url, name)
    finally:
        drop_database(database_url, name)


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (-p no:xdist) it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``-n 2``, the README's command), each of :data:`SERIAL` runs in one
    process, one test after another; every other test goes wherever a process is free. (Not
    ``--dist loadgroup``: pytest-xdist 3.8 renames the items' ``_nodeid``, and pytest 9 reads
    ``_id``, so its groups are silently ignored.)"""
    # imported here: this hook is only called when pytest-xdist runs the session
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for group in SERIAL if nodeid.startswith(group)), nodeid)

    return Scheduling(config, log)


@pytest.fixture
def broker_url(db_url: str) -> str:
    """The ``db_url`` database as a Celery broker URL (pgbroker+postgresql://)."""
    return "pgbroker+" + db_url


@pytest.fixture
def pg(db_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit psycopg connection to ``db_url``, closed after the test."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        yield conn


@pytest.fixture(autouse=True)
def _stop_celery_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Stop every worker/beat process started during the test, even when the test failed.

    Also points ``tests.support.processes`` at this test's ``tmp_path`` for the processes' log
    files.
    """
    before = set(processes.live_processes())
    processes.log_dir_provider = lambda: request.getfixturevalue("tmp_path") / "celery-logs"
    try:
        yield
    finally:
        processes.log_dir_provider = None
        for proc in processes.live_processes():
            if proc not in before:
                proc.stop()
