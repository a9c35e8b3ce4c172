"""Find the PostgreSQL server to use for the demo and for the tests.

Not part of the broker itself: production code is given its URL explicitly. This module answers
"which database do I talk to on this machine?" in a fixed order:

1. ``PGBROKER_DATABASE_URL`` if it is set (``postgresql://``, ``postgres://``, ``pgbroker://`` and
   ``pgbroker+postgresql://`` are accepted and normalised to ``postgresql://``);
2. ``PGBROKER_EMBEDDED`` set to a true value (``1``, ``true``, ``yes``, ``on``) skips step 3;
3. the local server ``postgresql://postgres@127.0.0.1:5432/postgres``, if a connection to it
   succeeds within 2 seconds;
4. a throwaway server started with the optional ``pgserver`` package
   (``pip install pgbroker[embedded]``). It listens on a unix socket only (no TCP port), lives in a
   temporary directory and is stopped and deleted when the process that started it exits.
   ``PGBROKER_EMBEDDED_DATADIR`` names a persistent data directory instead (it is kept, and the
   server stopped, at exit).

Limits, said honestly: the embedded server belongs to the process that started it. Children of that
process must be handed the URL (the test helpers do so through the environment); a child calling
:func:`resolve_database_url` itself would start its own server. If the starting process is killed
with SIGKILL, the embedded server is left running and its directory left on disk.

Running as root: PostgreSQL refuses to run as root. ``pgserver`` handles it by creating a system
user ``pgserver`` (with ``useradd``), chowning the data directory to it and adding read/traverse
permission for "other" on every parent directory of the data directory and of its bundled binaries.
This module therefore keeps the default data directory in a fresh temporary directory, never in
root's home.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psycopg

__all__ = [
    "DEFAULT_LOCAL_URL",
    "ENV_DATABASE_URL",
    "ENV_EMBEDDED",
    "ENV_EMBEDDED_DATADIR",
    "admin_url",
    "normalize_url",
    "resolve_database_url",
    "start_embedded_server",
]

logger = logging.getLogger(__name__)

ENV_DATABASE_URL: Final = "PGBROKER_DATABASE_URL"
ENV_EMBEDDED: Final = "PGBROKER_EMBEDDED"
ENV_EMBEDDED_DATADIR: Final = "PGBROKER_EMBEDDED_DATADIR"

DEFAULT_LOCAL_URL: Final = "postgresql://postgres@127.0.0.1:5432/postgres"
#: libpq's connect_timeout is in whole seconds and treats values below 2 as 2.
PROBE_TIMEOUT_SECONDS: Final = 2

# Schemes accepted on input; all of them mean "a libpq URL" once the prefix is dropped.
_ACCEPTED_SCHEMES: Final = frozenset(
    {
        "postgresql",
        "postgres",
        "pgbroker",
        "pgbroker+postgresql",
        "pgbroker+postgres",
    }
)
_TRUE_WORDS: Final = frozenset({"1", "true", "yes", "on"})

# One embedded server per process: data directory -> URL of its ``postgres`` database.
_embedded_urls: dict[str, str] = {}
_embedded_lock = threading.Lock()


def normalize_url(url: str) -> str:
    """Return ``url`` as a libpq ``postgresql://`` URL.

    Accepts the ``postgresql://``, ``postgres://``, ``pgbroker://`` and ``pgbroker+postgresql://``
    forms; everything after the scheme is kept unchanged.

    Raises:
        ValueError: ``url`` is not a URL or has another scheme (``mysql://``, a ``key=value``
            conninfo string, ...).
    """
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme.lower() not in _ACCEPTED_SCHEMES:
        raise ValueError(
            f"not a PostgreSQL URL: {_redact(url)!r} "
            f"(expected one of: {', '.join(s + '://' for s in sorted(_ACCEPTED_SCHEMES))})"
        )
    return f"postgresql://{rest}"


def admin_url(url: str, dbname: str) -> str:
    """Return ``url`` with its database name replaced by ``dbname``.

    The scheme, user, password, host, port and query (``?host=/socket/dir`` included) are kept as
    they are, so ``pgbroker+postgresql://u@h/app`` gives ``pgbroker+postgresql://u@h/<dbname>``.
    Tests use it to connect to the databases they create.

    Raises:
        ValueError: ``url`` is not a URL, or ``dbname`` is empty.
    """
    if not dbname:
        raise ValueError("dbname must not be empty")
    parts = urlsplit(url.strip())
    if not parts.scheme or "://" not in url:
        raise ValueError(f"not a URL: {_redact(url)!r}")
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))


def database_name(url: str) -> str | None:
    """Return the database name in ``url``, or None when the URL names none."""
    path = urlsplit(url.strip()).path
    name = unquote(path.lstrip("/"))
    return name or None


def resolve_database_url(purpose: str = "pgbroker") -> str:
    """Return the URL (``postgresql://...``) of the PostgreSQL server to use on this machine.

    See the module docstring for the order in which servers are tried. ``purpose`` only names the
    caller in log messages and in the embedded server's temporary directory
    (``tests``, ``demo``, ...).

    Raises:
        ValueError: ``PGBROKER_DATABASE_URL`` is set but is not a PostgreSQL URL.
        RuntimeError: an embedded server is needed but ``pgserver`` is not installed, or it
            failed to start.
    """
    configured = os.environ.get(ENV_DATABASE_URL, "").strip()
    if configured:
        logger.debug("%s: using %s from the environment", purpose, ENV_DATABASE_URL)
        return normalize_url(configured)

    if _env_true(ENV_EMBEDDED):
        logger.debug("%s: %s is set, skipping the local server", purpose, ENV_EMBEDDED)
    elif _can_connect(DEFAULT_LOCAL_URL):
        logger.debug("%s: using the local server at %s", purpose, DEFAULT_LOCAL_URL)
        return DEFAULT_LOCAL_URL
    else:
        logger.info(
            "%s: no PostgreSQL at %s, starting an embedded server", purpose, DEFAULT_LOCAL_URL
        )

    datadir = os.environ.get(ENV_EMBEDDED_DATADIR, "").strip()
    return start_embedded_server(purpose, datadir=Path(datadir) if datadir else None)


def start_embedded_server(purpose: str = "pgbroker", *, datadir: Path | None = None) -> str:
    """Start (or reuse) an embedded PostgreSQL server and return its URL.

    With ``datadir=None`` the server lives in a new temporary directory that is deleted when this
    process exits. With a ``datadir`` the data is kept and the server is only stopped at exit.
    The server listens on a unix socket in its data directory and on no TCP port; the URL has the
    form ``postgresql://postgres@/postgres?host=<socket dir>&port=<port>``.

    Calling it again in the same process returns the same server's URL.

    Raises:
        RuntimeError: ``pgserver`` is not installed, or the server failed to start.
    """
    with _embedded_lock:
        if datadir is None and _embedded_urls:
            # Reuse the throwaway server this process already started, whatever its purpose.
            return next(iter(_embedded_urls.values()))
        key = str(datadir.expanduser().resolve()) if datadir is not None else None
        if key is not None and key in _embedded_urls:
            return _embedded_urls[key]

        pgserver = _import_pgserver()

        if datadir is None:
            tmp_root = Path(tempfile.mkdtemp(prefix=f"{_safe(purpose)}-pg-"))
            pgdata = tmp_root / "pgdata"
            cleanup_mode = "delete"
            # atexit runs handlers last-registered-first: registered before pgserver registers its
            # own stop-and-delete handler, this one runs after it and removes the now-empty parent.
            atexit.register(_remove_tree, tmp_root, os.getpid())
        else:
            pgdata = datadir.expanduser().resolve()
            pgdata.parent.mkdir(parents=True, exist_ok=True)
            cleanup_mode = "stop"

        try:
            server = pgserver.get_server(pgdata, cleanup_mode=cleanup_mode)
            url = _url_of(server)
        except Exception as exc:  # pgserver raises CalledProcessError, AssertionError, OSError...
            log_file = pgdata / "log"
            detail = ""
            if log_file.exists():
                detail = "\n" + log_file.read_text(errors="replace")[-4000:]
            raise RuntimeError(
                f"could not start the embedded PostgreSQL server in {pgdata}: {exc}{detail}"
            ) from exc

        _embedded_urls[key if key is not None else str(pgdata)] = url
        logger.info("%s: embedded PostgreSQL running in %s (%s)", purpose, pgdata, url)
        return url


def _import_pgserver() -> Any:
    """Import ``pgserver`` with a clear error when it is missing."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (containers, CI);
            # the fallback it picks (/tmp/runtime-<uid>) is fine for a lock file.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            import pgserver  # optional: the embedded extra (the error below says how to get it)
    except ImportError as exc:
        raise RuntimeError(
            "no PostgreSQL server found: set PGBROKER_DATABASE_URL, start PostgreSQL on "
            "127.0.0.1:5432, or install the embedded server with: pip install 'pgbroker[embedded]'"
        ) from exc
    return pgserver


def _url_of(server: Any) -> str:
    """Build a libpq URL from a running pgserver.PostgresServer."""
    info = server.get_postmaster_info()
    port = info.port or 5432
    if info.socket_dir is not None:
        # The port names the socket file (.s.PGSQL.<port>); say it so PGPORT cannot mislead libpq.
        return f"postgresql://postgres@/postgres?host={quote(str(info.socket_dir))}&port={port}"
    # Only on platforms without unix sockets: pgserver then binds 127.0.0.1.
    return f"postgresql://postgres@{info.hostname or '127.0.0.1'}:{port}/postgres"


def _can_connect(url: str) -> bool:
    """Return True if a connection to ``url`` succeeds within PROBE_TIMEOUT_SECONDS."""
    try:
        with psycopg.connect(url, connect_timeout=PROBE_TIMEOUT_SECONDS, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except (psycopg.Error, OSError) as exc:
        logger.debug("cannot connect to %s: %s", url, exc)
        return False
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE_WORDS


def _safe(text: str) -> str:
    """Keep a purpose string usable in a short directory name."""
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in text)
    return cleaned[:20] or "pgbroker"


def _remove_tree(path: Path, owner_pid: int) -> None:
    # A forked child inherits atexit handlers; only the process that made the directory removes it.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def _redact(url: str) -> str:
    """Hide the password of a URL for error messages."""
    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
            return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        pass
    return url
