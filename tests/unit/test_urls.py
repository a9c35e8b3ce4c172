"""Unit tests of broker URL handling: pgbroker._pg.driver.libpq_url / mask_password and the
conninfo the kombu Transport builds from a ``kombu.Connection`` (``_db.kombu_conninfo``; no
connection is opened)."""

from __future__ import annotations

from types import SimpleNamespace

import kombu
import pytest
from psycopg.conninfo import conninfo_to_dict

import pgbroker  # noqa: F401 - registers the pgbroker:// scheme with kombu
from pgbroker._pg import driver as _db
from pgbroker._pg.driver import kombu_conninfo, libpq_url, mask_password
from pgbroker.errors import ConfigurationError

SECRET = "s3cr3t"


# -- libpq_url ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), [
    ("pgbroker://u:p@h:5433/db", "postgresql://u:p@h:5433/db"),
    ("pgbroker+postgresql://u@h/db?sslmode=require", "postgresql://u@h/db?sslmode=require"),
    ("pgbroker+postgres://u@h/db", "postgresql://u@h/db"),
    ("pgbroker://u@/db?host=/socket/dir", "postgresql://u@/db?host=/socket/dir"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
    ("postgres://u@h/db", "postgres://u@h/db"),
    ("host=/tmp dbname=x", "host=/tmp dbname=x"),  # a key=value conninfo passes through
    ("pgbroker://", "postgresql://"),              # every parameter from libpq's defaults
])
def test_libpq_url(given: str, expected: str) -> None:
    assert libpq_url(given) == expected


@pytest.mark.parametrize("bad", ["", None, 5])
def test_libpq_url_refuses_an_empty_url(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="empty"):
        libpq_url(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [f"redis://u:{SECRET}@h:6379/0", f"mysql://u:{SECRET}@h/db",
                                 f"amqp://u:{SECRET}@h//"])
def test_libpq_url_refuses_other_schemes_without_showing_the_password(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="is not a PostgreSQL URL") as info:
        libpq_url(bad)
    assert SECRET not in str(info.value)
def test_libpq_url_scheme_is_case_insensitive() -> None:
    assert libpq_url("PGBROKER://u@h/db") == "postgresql://u@h/db"


# -- mask_password --------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), [
    (f"postgresql://u:{SECRET}@h/db", "postgresql://u:**@h/db"),
    (f"pgbroker://u:{SECRET}@h:5433/db?sslmode=require", "pgbroker://u:**@h:5433/db?sslmode=require"),
    (f"postgresql://u:p@{SECRET}@h/db", "postgresql://u:**@h/db"),  # '@' inside the password
    (f"postgresql://:{SECRET}@h/db", "postgresql://:**@h/db"),
    (f"postgresql://u:{SECRET}@[::1]:5432/db", "postgresql://u:**@[::1]:5432/db"),
    (f"postgresql://u:{SECRET}@h1,h2:5433/db", "postgresql://u:**@h1,h2:5433/db"),
    (f"postgresql://u:{SECRET}@/db?host=/socket/dir", "postgresql://u:**@/db?host=/socket/dir"),
])
def test_mask_password(given: str, expected: str) -> None:
    assert mask_password(given) == expected


def test_mask_password_of_a_key_value_conninfo() -> None:
    masked = mask_password(f"host=h password={SECRET} dbname=d")
    assert conninfo_to_dict(masked) == {"host": "h", "password": "**", "dbname": "d"}


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "postgresql://h/db", "host=h dbname=d",
                                 "postgresql://u@/db?host=/socket/dir"])
def test_mask_password_leaves_urls_without_password_unchanged(url: str) -> None:
    assert mask_password(url) == url


def test_mask_password_custom_mask() -> None:
    assert mask_password(f"postgresql://u:{SECRET}@h/db", mask="***") == "postgresql://u:***@h/db"
@pytest.mark.parametrize("given", [
    f"host=h password='x {SECRET}' dbname=d",
    f"host=h password = {SECRET} dbname=d",
    f"postgresql://u:other@h/db?password={SECRET}",
])
def test_mask_password_never_leaks(given: str) -> None:
    assert SECRET not in mask_password(given)


# -- _db.kombu_conninfo --------------------------------------------------------------------------

def conninfo_of(*args: object, **kwargs: object) -> dict[str, str]:
    """The libpq parameters the transport would connect with, for ``kombu.Connection(...)``."""
    return conninfo_to_dict(kombu_conninfo(kombu.Connection(*args, **kwargs)))


def test_kombu_resolves_the_pgbroker_scheme() -> None:
    assert kombu.Connection("pgbroker://u@h/db").transport_cls == "pgbroker"
    assert kombu.Connection("pgbroker+postgresql://u@h/db").transport_cls == "pgbroker"


def test_conninfo_of_a_pgbroker_url() -> None:
    assert conninfo_of(f"pgbroker://u:{SECRET}@db.example:5433/app") == {
        "user": "u", "password": SECRET, "host": "db.example", "port": "5433", "dbname": "app"}


def test_conninfo_of_a_full_libpq_url_after_the_plus() -> None:
    params = conninfo_of("pgbroker+postgresql://u@h1:5432,h2:5433/app"
                         "?target_session_attrs=read-write&sslmode=require")
    assert params == {"user": "u", "host": "h1,h2", "port": "5432,5433", "dbname": "app",
                      "target_session_attrs": "read-write", "sslmode": "require"}


def test_conninfo_of_a_url_with_empty_host_and_a_socket_directory() -> None:
    url = "pgbroker+postgresql://postgres@/app?host=/socket/dir"
    assert conninfo_of(url) == {"user": "postgres", "dbname": "app", "host": "/socket/dir"}


def test_libpq_options_go_after_pgbroker_plus() -> None:
    # kombu parses a pgbroker:// URL itself (as amqp://) and takes a query string for its own
    # keyword arguments: libpq's options belong in the libpq URL after "pgbroker+"
    with pytest.raises(TypeError, match="host"):
        kombu.Connection("pgbroker://postgres@/app?host=/socket/dir")


def test_kombu_parses_a_pgbroker_url_and_its_failover_alternates() -> None:
    conn = kombu.Connection("pgbroker://u@h1:5433/db;pgbroker://u@h2:5434/db")
    assert (conn.hostname, conn.port, conn.userid, conn.virtual_host) == ("h1", 5433, "u", "db")
    assert conn.alt == ["pgbroker://u@h1:5433/db", "pgbroker://u@h2:5434/db"]
    conn.switch(conn.alt[1])
    assert conninfo_to_dict(kombu_conninfo(conn)) == {
        "host": "h2", "port": "5434", "user": "u", "dbname": "db"}


def test_a_libpq_multi_host_url_is_passed_to_libpq_whole() -> None:
    params = conninfo_of("pgbroker+postgresql://u@h1:5432,h2:5433/app"
                         "?target_session_attrs=read-write")
    assert params == {"user": "u", "host": "h1,h2", "port": "5432,5433", "dbname": "app",
                      "target_session_attrs": "read-write"}


def test_conninfo_keeps_percent_encoded_passwords() -> None:
    assert conninfo_of("pgbroker://u:p%40ss%2Fw@h/db")["password"] == "p@ss/w"


def test_conninfo_of_an_empty_pgbroker_url_is_libpq_defaults() -> None:
    assert conninfo_of("pgbroker://") == {}


def test_conninfo_from_separate_connection_arguments() -> None:
    params = conninfo_of(hostname="h", port=5433, userid="u", password=SECRET,
                         virtual_host="app", transport="pgbroker")
    assert params == {"host": "h", "port": "5433", "user": "u", "password": SECRET,
                      "dbname": "app"}


def test_conninfo_without_a_database_name_uses_libpq_default() -> None:
    params = conninfo_of(hostname="h", transport="pgbroker")
    assert params.get("dbname") in (None, "")


def test_conninfo_passes_a_key_value_string_through() -> None:
    client = SimpleNamespace(hostname="host=/socket/dir dbname=app user=u", port=None,
                             userid=None, password=None, virtual_host=None)
    assert kombu_conninfo(client) == "host=/socket/dir dbname=app user=u"


@pytest.mark.parametrize("url", [f"pgbroker://u:{SECRET}@h:5433/db",
                                 f"pgbroker+postgresql://u:{SECRET}@h:5433/db?sslmode=require"])
def test_as_uri_hides_the_password_and_keeps_the_scheme(url: str) -> None:
    conn = kombu.Connection(url)
    shown = conn.as_uri()
    # still names this transport, and marks the password (kombu leaves out a query string)
    assert shown == url.replace(SECRET, "**").partition("?")[0]
    assert kombu.Connection(shown).transport_cls == "pgbroker"
    assert SECRET not in repr(conn)
    # the libpq URL's password lives in kombu's password field once the transport exists
    # (Celery prints the hostname in inspect stats, never the password)
    conn.transport  # noqa: B018 - made on first access
    assert SECRET not in conn.hostname and conn.password == SECRET
    assert SECRET not in conn.as_uri()
def test_as_uri_marks_where_the_password_was() -> None:
    # kombu's convention (amqp://guest:**@host//): the reader sees that a password is set
    assert kombu.Connection(f"pgbroker://u:{SECRET}@h/db").as_uri() == \
        "pgbroker://u:**@h:5432/db"


def test_as_uri_of_a_multi_host_netloc() -> None:
    # kombu's sanitizer takes "5432,h2:5433" for a port: Celery's banner killed the worker
    conn = kombu.Connection(f"pgbroker+postgresql://u:{SECRET}@h1:5432,h2:5433/app"
                            "?target_session_attrs=read-write")
    assert conn.as_uri() == "pgbroker+postgresql://u:**@h1:5432,h2:5433/app"
    assert SECRET not in conn.as_uri(include_password=True)  # it lives in kombu's field now
    assert conninfo_to_dict(kombu_conninfo(conn))["host"] == "h1,h2"


def test_alternates_of_plus_urls_are_refused_at_once() -> None:
    # kombu parses the next alternate itself at a failover, and drops a "+" URL's libpq part
    conn = kombu.Connection("pgbroker+postgresql://u@h1/db;pgbroker+postgresql://u@h2/db")
    with pytest.raises(ConfigurationError, match="one libpq URL"):
        conn.transport  # noqa: B018 - building the transport is what refuses


# -- the server that took the last connection first (a dark old primary: docs/chaos.md) -----------

_TWO = "postgresql://u@a:5432,b:5433/app?target_session_attrs=read-write"


def _reordered(url: str, good: tuple[str, str] | None, monkeypatch: pytest.MonkeyPatch
               ) -> dict[str, str]:
    if good is not None:
        monkeypatch.setitem(_db._last_good, url, good)
    return _db._last_good_first(url, conninfo_to_dict(url))


def test_the_server_that_took_the_last_connection_is_tried_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _reordered(_TWO, ("b", "5433"), monkeypatch) == {"host": "b,a", "port": "5433,5432"}
    assert _reordered(_TWO, ("a", "5432"), monkeypatch) == {}  # first already
    assert _reordered(_TWO, None, monkeypatch) == {}  # nothing known yet: libpq's order
    no_ports = "postgresql://u@/app?host=a,b&target_session_attrs=read-write"
    assert _reordered(no_ports, ("b", "5432"), monkeypatch) == {"host": "b,a"}


def test_the_last_good_server_moves_to_the_front_and_the_rest_keep_their_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    url = ("postgresql://u@/app?host=a,b,c&port=5432&hostaddr=10.0.0.1,10.0.0.2,10.0.0.3"
           "&target_session_attrs=primary")
    assert _reordered(url, ("c", "5432"), monkeypatch) == {
        "host": "c,a,b", "port": "5432,5432,5432", "hostaddr": "10.0.0.3,10.0.0.1,10.0.0.2"}


@pytest.mark.parametrize("url", [
    "postgresql://u@a:5432,b:5433/app",  # no role asked for: the hosts may be a preference order
    "postgresql://u@a:5432,b:5433/app?target_session_attrs=any",
    "postgresql://u@a:5432,b:5433/app?target_session_attrs=read-write&load_balance_hosts=random",
    "postgresql://u@/app?host=a,b&port=5432,5433,5434&target_session_attrs=read-write",  # libpq's
], ids=["no-role", "any", "load-balanced", "mismatched-lists"])
def test_the_hosts_keep_their_order(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _reordered(url, ("b", "5433"), monkeypatch) == {}
