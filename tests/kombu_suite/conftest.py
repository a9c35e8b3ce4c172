"""Fixtures kombu's own ``t/integration/test_*.py`` give its suite, for pgbroker."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import kombu
import pytest

import pgbroker  # noqa: F401 - registers pgbroker://
from tests.support.db import free_port
from tests.kombu_suite import sdist


def pytest_configure(config: pytest.Config) -> None:
    # pytest's cache survives between the test modules of a run (and between runs on a
    # developer's machine): the sdist is downloaded once. (-p no:cacheprovider: a tmp dir.)
    cache = getattr(config, "cache", None)
    if cache is not None:
        sdist.cache_dir = cache.mkdir("kombu-sdist")


def _url(db_url: str, port: int | None = None) -> str:
    """``db_url`` as a plain ``pgbroker://`` URL, as a kombu user writes one."""
    parts = urlsplit(db_url)
    return (f"pgbroker://{parts.username or 'postgres'}@{parts.hostname}:"
            f"{port or parts.port or 5432}{parts.path}")


@pytest.fixture
def connection(db_url: str) -> Iterator[kombu.Connection]:
    conn = kombu.Connection(_url(db_url))
    yield conn
    conn.release()


@pytest.fixture
def invalid_connection(db_url: str) -> Iterator[kombu.Connection]:
    conn = kombu.Connection(_url(db_url, free_port()))
    yield conn
    conn.release()


@pytest.fixture
def failover_connection(db_url: str) -> Iterator[kombu.Connection]:
    # kombu's own: a dead first URL, then the live one (test_py_amqp.get_failover_connection)
    conn = kombu.Connection(f"{_url(db_url, free_port())};{_url(db_url)}")
    yield conn
    conn.release()
