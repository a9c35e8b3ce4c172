"""A throwaway PostgreSQL server that a test may restart, crash or cut off (the chaos scenarios,
the bench's pressure runs, the integration tests that need a server configured otherwise).

The shared server of the test session (127.0.0.1:5432) is used by every other test, so the
scenarios that stop the server start one of their own: ``initdb`` into a temporary directory,
``pg_ctl start`` on a free port of 127.0.0.1 (and a unix socket in the same directory), trust
authentication, dropped with its directory at the end of the module.

PostgreSQL refuses to run as root: as root, every command runs as the ``postgres`` system user
(``runuser -u postgres --``), which owns the data directory. The binaries are found in
``$PGBROKER_PG_BINDIR``, Debian's ``/usr/lib/postgresql/<version>/bin``, the directory of
``pg_ctl`` on PATH, or the ``pgserver`` package; without any, the tests that need a server of
their own are skipped, saying why.

Its fixtures, ``own_server`` (one per test module) and ``own_db``, are in tests/chaos/conftest.py.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql

from pgbroker.migrate import migrate
from tests.support.db import free_port

__all__ = ["ThrowawayServer", "find_bindir", "require_bindir", "throwaway_server"]

_names = itertools.count(1)


def find_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    candidates = [os.environ.get("PGBROKER_PG_BINDIR", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent))
    with contextlib.suppress(ImportError):
        import pgserver  # optional

        candidates.append(str(Path(pgserver.__file__).parent / "pginstall" / "bin"))
    for candidate in candidates:
        if candidate and all((Path(candidate) / exe).is_file()
                             for exe in ("initdb", "pg_ctl", "postgres")):
            return Path(candidate)
    return None


def require_bindir() -> Path:
    """:func:`find_bindir`, or skip the test saying why."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl, postgres) found: install "
                    "postgresql or set PGBROKER_PG_BINDIR")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start PostgreSQL as postgres")
    return bindir


class ThrowawayServer:
    """One PostgreSQL cluster in a temporary directory, on ``127.0.0.1:<port>``."""

    def __init__(self, bindir: Path, password: str | None = None,
                 settings: dict[str, str] | None = None, listen: str = "127.0.0.1"):
        """``password``: the ``postgres`` user's password, and scram-sha-256 authentication
        (the default is trust, no password). ``settings``: more ``-c name=value`` server
        settings; ``listen``: ``listen_addresses`` (``*`` for hosts in network namespaces)."""
        self.bindir = bindir
        self.password = password
        self.settings = dict(settings or {})
        self.listen = listen
        self.root = Path(tempfile.mkdtemp(prefix="pgbroker-chaos-pg-"))
        self.datadir = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self._user: str | None = None
        if os.geteuid() == 0:  # postgres refuses root: run it as the postgres system user
            self._user = "postgres"
            entry = pwd.getpwnam(self._user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    @property
    def socket_path(self) -> str:
        """The server's unix socket (a proxy in another network namespace connects there)."""
        return str(self.root / f".s.PGSQL.{self.port}")

    def url(self, dbname: str = "postgres") -> str:
        user = f"postgres:{quote(self.password, safe='')}" if self.password else "postgres"
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def allow(self, line: str) -> None:
        """Add a ``pg_hba.conf`` line (read at the next start or reload)."""
        with open(self.datadir / "pg_hba.conf", "a") as f:
            f.write(line + "\n")

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / argv[0]), *argv[1:]]
        if self._user:
            command = ["runuser", "-u", self._user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=self.root, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}):\n"
                               f"{done.stdout}\n{done.stderr}\n{self._log_tail()}")
        return done

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        return ""

    def init(self) -> ThrowawayServer:
        auth = ["-A", "trust"]
        if self.password:
            pwfile = self.root / "pwfile"
            pwfile.write_text(self.password + "\n")
            if self._user:
                entry = pwd.getpwnam(self._user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            auth = ["-A", "scram-sha-256", f"--pwfile={pwfile}"]
        self._run("initdb", "-D", str(self.datadir), "-U", "postgres", *auth,
                  "-E", "UTF8", "--locale=C", "--no-sync")
        return self

    def start(self) -> None:
        options = (f"-c port={self.port} -c listen_addresses={self.listen} "
                   f"-c unix_socket_directories={self.root} -c max_connections=100 "
                   "-c shared_buffers=32MB")
        options += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.datadir),
                  "-l", str(self.log), "-o", options)

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.datadir))

    def restart(self, mode: str = "fast") -> float:
        """``pg_ctl restart -m <mode>``; returns the seconds until it accepts connections."""
        started = time.monotonic()
        self._run("pg_ctl", "restart", "-w", "-t", "60", "-m", mode, "-D", str(self.datadir),
                  "-l", str(self.log))
        return time.monotonic() - started

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def create_database(self) -> str:
        """A new database, migrated with pgbroker's schema; returns its URL."""
        name = f"chaos_{os.getpid()}_{next(_names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        url = self.url(name)
        migrate(url)
        return url

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with contextlib.suppress(psycopg.Error), \
                psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


@contextlib.contextmanager
def throwaway_server(password: str | None = None, **kwargs: Any) -> Iterator[ThrowawayServer]:
    """A started :class:`ThrowawayServer`, destroyed on exit; skips the test without binaries.
    ``kwargs``: ``settings``, ``listen`` (see :class:`ThrowawayServer`)."""
    server = ThrowawayServer(require_bindir(), password, **kwargs)
    try:
        server.init().start()
        yield server
    finally:
        server.destroy()
