"""A real PgBouncer in front of a test's PostgreSQL, in transaction pooling mode.

The test starts Debian's ``pgbouncer`` (``apt-get install pgbouncer``) with an ini file of its
own in a temporary directory: ``pool_mode = transaction``, trust authentication, every database
of the upstream server (``* = host=... port=...``), a free port of 127.0.0.1. Skipped, saying
why, when the binary is missing. As root, PgBouncer runs as the ``postgres`` system user (it
refuses root).

Transaction pooling is what production poolers run: a server connection belongs to a client for
one transaction only, so session state (named prepared statements before PgBouncer 1.21, LISTEN,
session advisory locks, ``SET``) does not follow the client.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

__all__ = ["PgBouncer", "pgbouncer"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PgBouncer:
    """One ``pgbouncer`` process forwarding to ``host:port``."""

    def __init__(self, host: str, port: int, pool_mode: str = "transaction",
                 pool_size: int = 20, reset_always: bool = False):
        """``reset_always``: ``DISCARD ALL`` after every transaction
        (``server_reset_query_always``), so that no session state survives one, whichever
        server connection comes next."""
        exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(exe):
            pytest.skip("no pgbouncer binary: apt-get install pgbouncer")
        self.root = Path(tempfile.mkdtemp(prefix="pgbroker-pgbouncer-"))
        self.port = _free_port()
        self.log = self.root / "pgbouncer.log"
        (self.root / "users.txt").write_text('"postgres" ""\n')
        ini = self.root / "pgbouncer.ini"
        ini.write_text(f"""[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.root / "users.txt"}
admin_users = postgres
pool_mode = {pool_mode}
default_pool_size = {pool_size}
max_client_conn = 1000
server_reset_query = {"DISCARD ALL" if reset_always else ""}
server_reset_query_always = {1 if reset_always else 0}
ignore_startup_parameters = extra_float_digits
logfile = {self.log}
pidfile = {self.root / "pgbouncer.pid"}
""")
        argv = [exe, str(ini)]
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            argv = [exe, "-u", "postgres", str(ini)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    def url(self, db_url: str) -> str:
        """``db_url`` (postgresql://) pointed at this PgBouncer instead."""
        parts = urlsplit(db_url)
        user = parts.netloc.rpartition("@")[0]
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def show(self, what: str) -> list[tuple]:
        """``SHOW <what>`` on PgBouncer's admin console (``pools``, ``clients``, ``servers``)."""
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer",
                             autocommit=True, prepare_threshold=None) as admin:
            cur = admin.cursor()
            cur.execute(f"SHOW {what}", prepare=False)
            return cur.fetchall()

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def close(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def pgbouncer(host: str, port: int, **kwargs: object) -> Iterator[PgBouncer]:
    """A started :class:`PgBouncer` (skips without the binary), stopped on exit."""
    bouncer = PgBouncer(host, port, **kwargs)  # type: ignore[arg-type]
    try:
        yield bouncer
    finally:
        bouncer.close()
