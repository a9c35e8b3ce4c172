"""Fixtures of the integration tier (one process, a real database, no worker processes):

* ``app``, ``client`` -- the admin app on this test's database, and a test client logged in
  as alice (tests/integration/test_admin*.py; their logins and helpers: tests/support/admin.py);
* ``store`` -- a :class:`~pgbroker._pg.store.Store` on this test's database, with the options of
  tests/support/transport.py (no sweeping behind the test's back).

The fixtures of every tier (``db_url``, ``pg``...) are in tests/conftest.py; those several
tiers share (``runs``, ``producer``, ``cli``, ticketflow's) in tests/support/fixtures.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient

from pgbroker._pg.store import Store
from pgbroker.admin import create_app
from tests.support.admin import CREDS, csrf_of
from tests.support.transport import store_for


@pytest.fixture
def app(db_url: str, pg: psycopg.Connection) -> Iterator[Flask]:
    """The admin app (logins: tests.support.admin.CREDS) with one queue, ``q1``."""
    pg.execute("INSERT INTO pgbroker.queues (name) VALUES ('q1')")
    app = create_app(db_url, credentials=CREDS, refresh=1)
    app.config["TESTING"] = True
    yield app
    app.extensions["pgbroker"].close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    """A client logged in as alice."""
    client = app.test_client()
    token = csrf_of(client.get("/login").text)
    response = client.post("/login", data={"user": "alice", "password": "correct horse",
                                           "csrf_token": token})
    assert response.status_code == 303
    return client


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A store on this test's database (closed after the test)."""
    s = store_for(db_url)
    yield s
    s.close()
