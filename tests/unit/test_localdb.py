"""Unit tests of pgbroker._pg.local_server that need no database."""

from __future__ import annotations

import pytest

from pgbroker._pg import local_server as _localdb
from pgbroker._pg.local_server import admin_url, database_name, normalize_url, resolve_database_url


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@h:5433/db", "postgresql://u:p@h:5433/db"),
        ("postgres://u@h/db", "postgresql://u@h/db"),
        ("pgbroker://u@h/db", "postgresql://u@h/db"),
        ("pgbroker+postgresql://u@h/db?sslmode=require", "postgresql://u@h/db?sslmode=require"),
        ("PGBROKER+POSTGRESQL://u@h/db", "postgresql://u@h/db"),
        ("  pgbroker://u@/db?host=/tmp/x  ", "postgresql://u@/db?host=/tmp/x"),
    ],
)
def test_normalize_url(given: str, expected: str) -> None:
    assert normalize_url(given) == expected


@pytest.mark.parametrize(
    "bad", ["mysql://u@h/db", "host=h dbname=db", "", "redis://h:6379/0", "pgbroker:/x"]
)
def test_normalize_url_refuses_other_schemes(bad: str) -> None:
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        normalize_url(bad)


def test_normalize_url_error_hides_password() -> None:
    with pytest.raises(ValueError) as info:
        normalize_url("mysql://user:s3cret@h/db")
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://postgres@127.0.0.1:5432/postgres", "postgresql://postgres@127.0.0.1:5432/x"),
        ("postgresql://u:p@h/old?sslmode=disable", "postgresql://u:p@h/x?sslmode=disable"),
        ("postgresql://u@h", "postgresql://u@h/x"),
        ("postgresql://u@h/", "postgresql://u@h/x"),
        (
            "postgresql://postgres@/postgres?host=/tmp/d/pgdata&port=5432",
            "postgresql://postgres@/x?host=/tmp/d/pgdata&port=5432",
        ),
        ("pgbroker+postgresql://u@h/app", "pgbroker+postgresql://u@h/x"),
    ],
)
def test_admin_url_swaps_database(url: str, expected: str) -> None:
    assert admin_url(url, "x") == expected


def test_admin_url_quotes_name() -> None:
    url = admin_url("postgresql://u@h/db", "we ird/name")
    assert url == "postgresql://u@h/we%20ird%2Fname"
    assert database_name(url) == "we ird/name"


def test_admin_url_refuses_bad_input() -> None:
    with pytest.raises(ValueError):
        admin_url("host=h dbname=db", "x")
    with pytest.raises(ValueError):
        admin_url("postgresql://u@h/db", "")


def test_database_name() -> None:
    assert database_name("postgresql://u@h:1/abc?x=1") == "abc"
    assert database_name("postgresql://u@h") is None


def test_resolve_prefers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_DATABASE_URL", "pgbroker://me@db.example/app")
    monkeypatch.setenv("PGBROKER_EMBEDDED", "1")  # an explicit URL still wins
    monkeypatch.setattr(_localdb, "_can_connect", _fail)
    monkeypatch.setattr(_localdb, "start_embedded_server", _fail)
    assert resolve_database_url() == "postgresql://me@db.example/app"


def test_resolve_environment_must_be_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_DATABASE_URL", "redis://localhost")
    with pytest.raises(ValueError):
        resolve_database_url()


def test_resolve_uses_local_server_when_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGBROKER_DATABASE_URL", raising=False)
    monkeypatch.delenv("PGBROKER_EMBEDDED", raising=False)
    probed: list[str] = []
    monkeypatch.setattr(_localdb, "_can_connect", lambda url: probed.append(url) or True)
    monkeypatch.setattr(_localdb, "start_embedded_server", _fail)
    assert resolve_database_url() == _localdb.DEFAULT_LOCAL_URL
    assert probed == [_localdb.DEFAULT_LOCAL_URL]


@pytest.mark.parametrize("forced", [False, True])
def test_resolve_falls_back_to_embedded(monkeypatch: pytest.MonkeyPatch, forced: bool) -> None:
    monkeypatch.delenv("PGBROKER_DATABASE_URL", raising=False)
    monkeypatch.delenv("PGBROKER_EMBEDDED_DATADIR", raising=False)
    if forced:
        monkeypatch.setenv("PGBROKER_EMBEDDED", "yes")
        monkeypatch.setattr(_localdb, "_can_connect", _fail)
    else:
        monkeypatch.delenv("PGBROKER_EMBEDDED", raising=False)
        monkeypatch.setattr(_localdb, "_can_connect", lambda url: False)
    calls: list[tuple[str, object]] = []

    def fake_start(purpose: str, *, datadir: object = None) -> str:
        calls.append((purpose, datadir))
        return "postgresql://postgres@/postgres?host=/tmp/s&port=5432"

    monkeypatch.setattr(_localdb, "start_embedded_server", fake_start)
    assert resolve_database_url("demo").startswith("postgresql://postgres@/postgres?host=")
    assert calls == [("demo", None)]


def test_missing_pgserver_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_pgserver(name: str, *args: object, **kwargs: object) -> object:
        if name == "pgserver":
            raise ImportError("No module named 'pgserver'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pgserver)
    with pytest.raises(RuntimeError, match=r"pip install 'pgbroker\[embedded\]'"):
        _localdb._import_pgserver()


def _fail(*args: object, **kwargs: object) -> object:
    raise AssertionError("must not be called")
