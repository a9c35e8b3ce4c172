"""The one module that owns the driver: connections, URL handling, LISTEN and error translation.

Every connection is opened here (:func:`connect`; :func:`listen` for a LISTEN connection), with
TCP keepalives so that a dead peer is noticed, the session time zone pinned to UTC, and the
process id recorded: a connection inherited through ``fork()`` is never used or closed by the
child (closing it would end the parent's session). Over a multi-host URL that asks for the
writable server, the server that took the process's last connection is tried first
(:func:`_last_good_first`), and a connection left on another one is :func:`superseded`. A kombu
connection's fields become a libpq conninfo in :func:`kombu_conninfo`. (A connection to a
migrated schema: ``migrate.connect_ready``.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import psycopg

from ..errors import ConfigurationError, DatabaseUnavailable, PgBrokerError

logger = logging.getLogger(__name__)

#: Errors that mean "the connection is gone": Celery and kombu reconnect on these.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    psycopg.OperationalError,
    psycopg.InterfaceError,
    ConnectionError,
    OSError,
)

_SCHEMES = ("pgbroker+postgresql", "pgbroker+postgres", "pgbroker")

_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    # Unacknowledged data for this long ends the connection: a partitioned worker notices in
    # seconds instead of the kernel's ~15 minutes of retransmissions.
    "tcp_user_timeout": 30000,
}


#: Over a multi-host conninfo asking for one role (target_session_attrs): the (host, port) that
#: took this process's last connection, by the conninfo as given.
_last_good: dict[str, tuple[str, str]] = {}

_ONE_ROLE = frozenset({"read-write", "primary"})


def libpq_url(url: str) -> str:
    """Turn a ``pgbroker://`` or ``pgbroker+postgresql://`` URL into a libpq URL (and
    ``pgbroker+django://ALIAS`` into the conninfo of Django's database ``ALIAS``)."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError("the broker URL is empty")
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in _SCHEMES:
        return "postgresql://" + rest
    if sep and scheme.lower() in ("pgbroker+django", "django"):  # Django's database ALIAS
        # Django is optional: its settings are read only for a URL that names them
        from .django_db import alias_conninfo

        return alias_conninfo(rest.strip("/") or "default")
    if sep and scheme.lower() in ("postgresql", "postgres"):
        return url
    if "://" not in url:  # a libpq key=value conninfo string
        return url
    raise ConfigurationError(
        f"{mask_password(url)} is not a PostgreSQL URL: use pgbroker://user@host:port/dbname"
    )


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password (in the user part or a ``password=`` query parameter),
    and the password. Used so the password lives only in kombu's ``password`` field, which
    Celery leaves out of ``inspect stats`` and banners."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url, None
    password = parts.password
    netloc = parts.netloc
    if password is not None:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}@{host}"
    query = parts.query
    if "password=" in query:
        kept = []
        for item in query.split("&"):
            key, _, value = item.partition("=")
            if key == "password":
                password = unquote(value)
            else:
                kept.append(item)
        query = "&".join(kept)
    if password is None:
        return url, None
    return urlunsplit(parts._replace(netloc=netloc, query=query)), unquote(password)


def mask_password(url: str, mask: str = "**") -> str:
    """``url`` (a URL or a key=value conninfo) with every password replaced by ``mask``."""
    if "://" not in url:  # key=value: libpq's own parser finds it, quoted or not
        try:
            params = psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError:
            return "<unparsable conninfo>"
        if "password" not in params:
            return url
        return psycopg.conninfo.make_conninfo("", **{**params, "password": mask})
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, host = netloc.rsplit("@", 1)
            netloc = f"{userinfo.split(':', 1)[0]}:{mask}@{host}"
        query = "&".join(
            f"password={mask}" if item.partition("=")[0] == "password" else item
            for item in parts.query.split("&")) if parts.query else ""
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<unparsable URL>"


def kombu_conninfo(client: Any) -> str:
    """The libpq conninfo of a kombu connection (``client``): a ``pgbroker+postgresql://`` URL
    as libpq reads it, a key=value string as given, else the fields kombu parsed from a
    ``pgbroker://`` URL (or got as arguments)."""
    hostname = client.hostname
    if hostname and hostname.startswith("django://"):  # pgbroker+django://ALIAS
        return libpq_url(hostname)
    if hostname and "://" in hostname:  # pgbroker+postgresql://...: a libpq URL
        # Keep the password out of the URL kombu shows (inspect stats prints the hostname,
        # as_uri formats it): it moves to kombu's password field, which Celery never
        # prints, and the URL keeps "**" where it was.
        bare, password = split_password(hostname)
        if password is not None:
            client.hostname = mask_password(hostname)
            client.password = client.password or password
        url = libpq_url(bare)
        if client.password:
            return psycopg.conninfo.make_conninfo(url, password=client.password)
        return url
    if hostname and "=" in hostname:  # a key=value conninfo string
        return str(hostname)
    # a pgbroker:// URL kombu parsed, or separate arguments; no host ("pgbroker://"):
    # libpq's defaults (PGHOST, the local socket)
    dbname = client.virtual_host if client.virtual_host not in (None, "", "/") else None
    return psycopg.conninfo.make_conninfo(
        host=hostname or None, port=client.port or None, user=client.userid or None,
        password=client.password or None, dbname=dbname)


def refuse_plus_alternates(alternates: list[str]) -> None:
    """kombu's failover list (``a;b``) switches by parsing the next URL itself: a
    ``pgbroker+postgresql://`` one then loses its libpq part (and its options), so refuse the
    list at once rather than fail, or hang, at the failover."""
    if len(alternates) > 1 and any("+" in a.partition("://")[0] for a in alternates):
        raise ConfigurationError(
            "failover alternates (a;b) must be plain pgbroker:// URLs: kombu cannot switch to a "
            "pgbroker+postgresql:// one; list every server in one libpq URL instead: "
            "pgbroker+postgresql://user@host1:5432,host2:5432/db?target_session_attrs=read-write")


def multi_host(url: str | None) -> bool:
    """``url`` is a libpq URL naming several hosts in its netloc (``u@a:p,b:q``), which kombu's
    URL sanitizer cannot parse (it takes ``p,b:q`` for a port)."""
    if not url or "://" not in url:
        return False
    return "," in url.partition("://")[2].partition("/")[0]


def shown_url(url: str, include_password: bool = False, mask: str = "**") -> str:
    """A libpq URL as kombu's ``as_uri`` shows one: ``pgbroker+`` in front, no query string,
    the password masked (kombu's own sanitizer, for the URLs it can parse)."""
    shown = url if include_password else mask_password(url, mask)
    return "pgbroker+" + shown.partition("?")[0]


def connect_kwargs(application_name: str = "pgbroker",
                   connect_timeout: float = 10.0) -> dict[str, Any]:
    """The libpq parameters of every pgbroker connection (keepalives, so a dead peer is
    noticed; a timeout; a name in pg_stat_activity). For pools too."""
    return {**_KEEPALIVES, "connect_timeout": max(1, int(connect_timeout)),
            "application_name": application_name}


def connect(conninfo: str, *, autocommit: bool = True, connect_timeout: float = 10.0,
            application_name: str = "pgbroker", **kwargs: Any) -> psycopg.Connection[Any]:
    """Open a connection, translating failures to :class:`DatabaseUnavailable`."""
    url = libpq_url(conninfo)
    try:
        given = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid database URL {mask_password(url)}: {exc}") from None
    # Defaults only: keepalives, timeouts or a name set in the URL win.
    params = {k: v for k, v in connect_kwargs(application_name, connect_timeout).items()
              if k not in given}
    params.update(_last_good_first(url, given))
    params.update(kwargs)
    try:
        conn = psycopg.connect(url, autocommit=autocommit, **params)
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {mask_password(libpq_url(conninfo))}: "
            f"{first_line(exc)}"
        ) from exc
    if read_only(conn):
        conn.close()
        raise DatabaseUnavailable(
            f"cannot use PostgreSQL at {mask_password(libpq_url(conninfo))}: the server is "
            "read-only (a standby in recovery, or default_transaction_read_only); pgbroker "
            "writes: name the primary, or every server with target_session_attrs=read-write")
    if given.get("target_session_attrs") in _ONE_ROLE and "," in str(given.get("host", "")):
        _last_good[url] = server = (conn.info.host, str(conn.info.port))  # _last_good_first
        conn._pgbroker_writer = (url, server)  # type: ignore[attr-defined] # see superseded
    conn.execute("SET TIME ZONE 'UTC'")
    if not autocommit:
        conn.commit()
    conn._pgbroker_pid = os.getpid()  # type: ignore[attr-defined]
    return conn


def _last_good_first(url: str, given: dict[str, Any]) -> dict[str, str]:
    """``host``, ``port`` (and ``hostaddr``) of a multi-host ``url`` reordered so that the server
    that took this process's last connection over it comes first; {} to keep libpq's order.

    libpq tries the hosts in the order given, each until ``connect_timeout``. After a failover
    whose old primary's address went dark (packets dropped: a cloud failover, a moved VIP, a
    zone outage), every new connection would wait out ``connect_timeout`` on it before the
    promoted server -- and a worker opens several in a row (its store, its LISTEN connection,
    every reconnect). Only where the URL asks for one role (``target_session_attrs`` =
    ``read-write`` or ``primary``), where the server that had it last is the likeliest to have
    it still, and a wrong guess costs one refused attempt; not with ``load_balance_hosts`` =
    ``random``, nor where the hosts may be a preference order (any other role). pgjdbc's
    ``MultiHostChooser`` likewise tries first the hosts its ``GlobalHostStatusTracker`` last
    saw in the ``targetServerType`` asked for."""
    good = _last_good.get(url)
    hosts = str(given.get("host", "")).split(",")
    if (good is None or len(hosts) < 2 or given.get("load_balance_hosts") == "random"
            or given.get("target_session_attrs") not in _ONE_ROLE):
        return {}
    lists = {"host": hosts}
    for name in ("port", "hostaddr"):
        if given.get(name):
            items = str(given[name]).split(",")
            lists[name] = items * len(hosts) if name == "port" and len(items) == 1 else items
    if any(len(items) != len(hosts) for items in lists.values()):
        return {}  # libpq refuses these lists itself, saying why
    ports = lists.get("port")  # (none given: libpq's one default for all, so the host alone)
    at = next((i for i, host in enumerate(hosts)
               if host == good[0] and (ports is None or ports[i] == good[1])), 0)
    if at == 0:
        return {}
    order = [at] + [i for i in range(len(hosts)) if i != at]
    return {name: ",".join(items[i] for i in order) for name, items in lists.items()}


def superseded(conn: psycopg.Connection[Any] | None) -> bool:
    """A later connection of this process over ``conn``'s multi-host URL (one that asks for the
    writable server) found it on another server than ``conn``'s: ``conn`` is on the old primary
    (a failover), whose address may have gone dark, so that its own TCP timers would take
    ``tcp_user_timeout`` -- on an idle connection, the keepalives -- to give it up. Its users
    drop it before they send anything more. False for any other connection."""
    writer = getattr(conn, "_pgbroker_writer", None)
    return writer is not None and _last_good.get(writer[0]) != writer[1]


def ensure_current(conn: psycopg.Connection[Any] | None, what: str) -> None:
    """Raise :class:`DatabaseUnavailable` (a lost connection: Celery and kombu connect again)
    when ``conn`` is :func:`superseded`."""
    if superseded(conn):
        raise DatabaseUnavailable(f"{what} is on the old primary: another connection found the "
                                  "writable server elsewhere (a failover)")


def read_only(conn: psycopg.Connection[Any]) -> bool:
    """The server said at connect (PostgreSQL 14+ reports both, no round trip) that it takes no
    writes: a standby before its promotion, whose sessions fail every write and LISTEN. A
    pooler that does not forward them (PgBouncer) says neither."""
    status = conn.info.parameter_status
    return "on" in (status("in_hot_standby"), status("default_transaction_read_only"))


def close(conn: psycopg.Connection[Any] | None) -> None:
    """Close ``conn`` if this process opened it; forget it silently otherwise."""
    if conn is None or conn.closed:
        return
    if getattr(conn, "_pgbroker_pid", None) != os.getpid():
        return  # inherited through fork: the parent still uses this session
    with contextlib.suppress(Exception):
        conn.close()


def owned(conn: psycopg.Connection[Any] | None) -> bool:
    """True when ``conn`` is open and was opened by this process."""
    return (conn is not None and not conn.closed
            and getattr(conn, "_pgbroker_pid", None) == os.getpid())


# -- LISTEN ----------------------------------------------------------------------------------------

def listen(conninfo: str, channel: str, *, connect_timeout: float = 10.0,
           application_name: str = "pgbroker listen",
           what: str = "LISTEN") -> psycopg.Connection[Any]:
    """A new connection that LISTENs on ``channel`` (closed again if the LISTEN fails)."""
    conn = connect(conninfo, connect_timeout=connect_timeout, application_name=application_name)
    try:
        with translate_errors(what):
            conn.execute(f'LISTEN "{channel}"')
    except BaseException:
        close(conn)
        raise
    return conn


def wait_readable(fd: int, timeout: float) -> bool:
    """Wait until ``fd`` is readable or ``timeout`` seconds pass; True if it is."""
    return wait_ready(fd, timeout)[0]


def wait_ready(fd: int, timeout: float | None = None, read: bool = True,
               write: bool = False) -> tuple[bool, bool]:
    """Wait until ``fd`` is readable (``read``) or writable (``write``), or ``timeout`` seconds
    pass (None: however long); returns (readable, writable), an error or hang-up counting as
    both (the caller's next call on it says which). poll() where there is one: select() fails
    on descriptors above 1023 (a busy web process, gevent). Looked up per call, so that
    gevent's patching applies."""
    poll = getattr(select, "poll", None)
    if poll is None:
        readable, writable, _ = select.select([fd] if read else [], [fd] if write else [], [],
                                              timeout)
        return bool(readable), bool(writable)
    poller = poll()
    poller.register(fd, (select.POLLIN if read else 0) | (select.POLLOUT if write else 0))
    events = 0
    for _, event in poller.poll(None if timeout is None else timeout * 1000):
        events |= event
    failed = events & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
    return bool(events & select.POLLIN or failed), bool(events & select.POLLOUT or failed)


def notifications(conn: psycopg.Connection[Any], what: str = "the LISTEN connection",
                  read: bool = True) -> list[str]:
    """The payloads of the notifications that arrived on ``conn``, in order; never blocks
    (libpq reads what is there). ``read=False``: only those in what libpq has read already
    (its buffer), the socket left alone. A connection the server closed raises
    :class:`DatabaseUnavailable` ("``what`` was closed by the server"); the caller translates
    the driver's own errors (:func:`translate_errors`)."""
    pgconn = conn.pgconn
    if read:
        pgconn.consume_input()
    else:
        pgconn.is_busy()  # parses the buffer (a NOTIFY behind a result) without a read
    if pgconn.status != psycopg.pq.ConnStatus.OK:
        raise DatabaseUnavailable(f"{what} was closed by the server")
    payloads = []
    while (note := pgconn.notifies()) is not None:
        payloads.append(note.extra.decode("utf-8", "replace"))
    return payloads


# -- errors ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn driver errors that mean the connection is gone (:func:`lost_connection`) into
    :class:`DatabaseUnavailable` (``__cause__`` kept); a statement that failed on a living
    connection (a full disk, a timeout, a deadlock) is raised as psycopg raised it."""
    try:
        yield
    except PgBrokerError:
        raise
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        # a standby reached without target_session_attrs, or a demoted primary: as good as gone
        raise DatabaseUnavailable(f"{what}: the server is read-only: {first_line(exc)}") from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        if not lost_connection(exc):
            raise
        raise DatabaseUnavailable(f"{what}: {first_line(exc)}") from exc


#: SQLSTATEs that end the session (besides class 08, connection exceptions): the server shuts
#: down or crashed, it cannot take connections now, the session was terminated or timed out.
_SESSION_ENDED = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03"})


def lost_connection(exc: BaseException) -> bool:
    """Whether ``exc`` means the connection is gone -- reconnect -- rather than that a statement
    failed on a living one. psycopg raises ``OperationalError`` for both: a full disk (53100),
    out of memory (53200), a statement timeout (57014) and a lock timeout (55P03) leave the
    session alive, and restarting a consumer for them claims new jobs it cannot settle either
    (DESIGN.md). An error with no SQLSTATE came from libpq, not from the server: the link."""
    if isinstance(exc, (DatabaseUnavailable, psycopg.InterfaceError)):
        return True
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        if state is None:
            return isinstance(exc, psycopg.OperationalError)
        return state.startswith("08") or state in _SESSION_ENDED
    return isinstance(exc, OSError)


#: A statement rolled back whole that may simply be sent again, when it ran on its own (no
#: transaction of the caller's around it): a deadlock, or a serialization failure -- under READ
#: COMMITTED only a row moved to the other partition of jobs (0020: an ack, an expiry, a revoke)
#: between the statement's snapshot and its lock on the row.
RERUN_ERRORS = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

#: Tries in all of a statement that fails with one of :data:`RERUN_ERRORS` (each with a fresh
#: snapshot: a claim meets a moved row only if it was claimed and acked during the claim).
RERUN_TRIES = 5


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
