"""The fixtures more than one tier uses, loaded for every tier by ``tests/conftest.py``
(``pytest_plugins``): no test module imports a fixture.

* ``runs``, ``producer`` -- the e2e app (``tests/apps/e2e_app.py``) publishing into this test's
  database, and its ``public.runs`` table: the e2e, chaos and some integration tests.
* ``tf_url``, ``session``, ``event`` -- the ticketflow example on this test's database: its
  integration and e2e tests.
* ``django_db`` -- the Django test project (``tests/apps/django_project``) configured in this
  process, its ``default`` connection on this test's database: the Django tests.
* ``cli`` -- ``pgbroker`` commands run in-process against this test's database: the integration
  tests of the commands, and the e2e tests that drive real workers with them.

The Celery apps are imported by the fixtures that use them, not here: importing a Celery app
makes it Celery's current app, which a test that never asked for it must not see.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from celery import Celery, current_app
from psycopg.conninfo import conninfo_to_dict

from tests.support.processes import Run
from tests.support.producers import drop_pools, point_producer

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@pytest.fixture
def cli(db_url: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli("stats", "--json")`` -> (exit status, stdout, stderr), against the test database."""
    from pgbroker.cli import main  # the commands: loaded by the tests that run them

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--database-url", db_url, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def runs(pg: psycopg.Connection) -> psycopg.Connection:
    """The test database with ``public.runs`` (one row per task run) created; returns ``pg``."""
    from tests.apps import e2e_app as e2e  # see the module docstring: the current app

    pg.execute(e2e.RUNS_DDL)
    return pg


@pytest.fixture
def producer(broker_url: str, runs: psycopg.Connection) -> Iterator[Celery]:
    """``tests.apps.e2e_app.app`` publishing into this test's database (default transport
    options)."""
    from tests.apps import e2e_app as e2e  # see the module docstring: the current app

    point_producer(e2e.app, broker_url)
    # Connect now, so a test's first publish is not slowed by connecting (and checking the
    # schema): countdown tests compare the publish time with the row's created_at.
    with e2e.app.producer_or_acquire() as warm:
        warm.connection.ensure_connection(max_retries=3)
        warm.channel  # noqa: B018 - opens the channel (the transport's store connection)
    try:
        yield e2e.app
    finally:
        drop_pools(e2e.app)


@pytest.fixture
def tf_url(broker_url: str, db_url: str) -> Iterator[str]:
    """``db_url`` with ticketflow's schema migrated; ``ticketflow.app`` publishes there."""
    import ticketflow  # see the module docstring: the current app
    from ticketflow import db  # (and its app: imported with the package, above)

    db.migrate(db_url)
    app = ticketflow.app
    options = dict(app.conf.broker_transport_options)
    original = app.conf.broker_url
    previous = current_app._get_current_object()
    point_producer(app, broker_url, options)
    app.set_current()
    try:
        yield db_url
    finally:
        db.dispose()
        point_producer(app, original, options)
        previous.set_current()


@pytest.fixture
def session(tf_url: str) -> Iterator[Session]:
    """A ticketflow database session on ``tf_url``."""
    from ticketflow import db  # see the module docstring: the current app

    with db.session(tf_url) as s:
        yield s


@pytest.fixture
def event(session: Session) -> int:
    """An event with 20 seats; returns its id."""
    from ticketflow import services  # see the module docstring: the current app

    return services.create_event(session, "Test concert", 20).id


def _setup_django() -> None:
    """Configure Django from the test project's settings module (no DJANGO_SETTINGS_MODULE in
    this process's environment, which every worker started later by other tests would
    inherit)."""
    # Django: only the Django tests configure it
    import django
    from django.conf import settings

    if not settings.configured:
        from tests.apps.django_project import settings as project

        settings.configure(**{k: getattr(project, k) for k in dir(project) if k.isupper()})
        django.setup()


@pytest.fixture
def django_db(db_url: str) -> Iterator[Any]:
    """Django's ``default`` connection on this test's database, with the shop's tables."""
    _setup_django()
    # Django: only the Django tests configure it
    from django.core.management import call_command
    from django.db import connections

    conn = connections["default"]
    conn.close()
    params = conninfo_to_dict(db_url)
    conn.settings_dict.update(NAME=params["dbname"], USER=params.get("user", ""),
                              PASSWORD=params.get("password", ""),
                              HOST=params.get("host", ""), PORT=str(params.get("port", "")))
    call_command("migrate", "shop", verbosity=0)
    try:
        yield conn
    finally:
        conn.close()
