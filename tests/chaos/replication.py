"""A primary and a streaming standby of PostgreSQL, for the failover scenarios.

Built the way an HA deployment is: ``initdb`` for the primary, ``pg_basebackup -R`` (streamed
WAL, ``standby.signal`` and ``primary_conninfo`` written) for the standby, each a
:class:`~tests.support.throwaway.ThrowawayServer` on a port of its own. With
``synchronous=True`` the primary runs with ``synchronous_standby_names`` naming the standby, so
a commit returns only once the standby has flushed it (what Patroni's synchronous mode and the
cloud services' "zero data loss" failover rely on); otherwise replication is asynchronous and a
crash of the primary can lose what it committed and had not yet sent.

A failover is :meth:`Cluster.fail_over`: ``pg_ctl stop -m immediate`` on the primary (a crash:
no checkpoint, every session cut), then ``pg_ctl promote -w`` on the standby. The new primary is
not synchronous (no standby is left to wait for). Clients use :meth:`Cluster.url`, a libpq
multi-host URL with ``target_session_attrs=read-write``.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psycopg
import pytest

from tests.support.throwaway import ThrowawayServer, require_bindir

__all__ = ["Cluster", "cluster"]

STANDBY_NAME = "standby1"


@dataclass
class Cluster:
    primary: ThrowawayServer
    standby: ThrowawayServer
    synchronous: bool
    promoted_at: float | None = None  # time.time() when the promotion finished

    def url(self, dbname: str = "postgres", hosts_in_query: bool = True) -> str:
        """A libpq multi-host URL over both servers that connects to the writable one: the
        hosts as ``?host=a,b&port=p,q`` or (``hosts_in_query=False``) in the netloc,
        ``postgresql://user@a:p,b:q/db``."""
        params = "target_session_attrs=read-write&connect_timeout=3"
        if hosts_in_query:
            return (f"postgresql://postgres@/{dbname}?host=127.0.0.1,127.0.0.1"
                    f"&port={self.primary.port},{self.standby.port}&{params}")
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/{dbname}?{params}"

    def broker_url(self, dbname: str, form: str) -> str:
        """The broker URL of ``dbname`` in one of the forms a user may write: ``query`` and
        ``netloc`` (:meth:`url`), or ``alternates``: kombu's own failover list of plain
        ``pgbroker://`` URLs joined by ``;`` (kombu refuses a query string there, so libpq
        cannot be told ``target_session_attrs``: pgbroker refuses a read-only server itself)."""
        if form == "alternates":
            return ";".join(f"pgbroker://postgres@127.0.0.1:{server.port}/{dbname}"
                            for server in (self.primary, self.standby))
        return "pgbroker+" + self.url(dbname, hosts_in_query=form == "query")

    def create_database(self) -> str:
        """A migrated database on the primary (replicated to the standby); its name."""
        url = self.primary.create_database()
        self.wait_replayed()
        return url.rsplit("/", 1)[1]

    def wait_replayed(self, timeout: float = 30) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        with psycopg.connect(self.primary.url(), autocommit=True) as pg:
            lsn = pg.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.standby.url(), autocommit=True) as sb:
            while sb.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                             (lsn,)).fetchone()[0] is not True:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the standby did not replay {lsn} in {timeout}s")
                time.sleep(0.05)

    def fail_over(self, detection: float = 3.0) -> tuple[float, float]:
        """Crash the primary, wait ``detection`` seconds (what Patroni or a cloud service takes
        to decide; clients meanwhile find only a read-only standby), promote the standby;
        returns (crash, promoted) as time.time()."""
        crashed = time.time()
        self.primary.stop("immediate")
        time.sleep(detection)
        self.standby._run("pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.standby.datadir))
        self.promoted_at = time.time()
        return crashed, self.promoted_at

    @property
    def current(self) -> ThrowawayServer:
        """The server that takes writes now."""
        return self.standby if self.promoted_at else self.primary


def _standby_of(primary: ThrowawayServer, listen: str) -> ThrowawayServer:
    standby = ThrowawayServer(primary.bindir, listen=listen)
    standby._run("pg_basebackup", "-D", str(standby.datadir), "-R", "-X", "stream", "-N",
                 "-c", "fast", "-d",
                 f"host=127.0.0.1 port={primary.port} user=postgres "
                 f"application_name={STANDBY_NAME}")
    with open(standby.datadir / "postgresql.auto.conf", "a") as f:  # later lines win
        f.write(f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
                f"application_name={STANDBY_NAME}'\n")
    standby.start()
    return standby


@contextlib.contextmanager
def cluster(synchronous: bool = True, listen: tuple[str, str] = ("127.0.0.1", "127.0.0.1"),
            hba: Sequence[str] = ()) -> Iterator[Cluster]:
    """A started primary and standby (skips the test without the binaries), destroyed on exit.
    ``listen``: the primary's and the standby's ``listen_addresses`` (127.0.0.1 among them:
    replication and :meth:`Cluster.url` use it); ``hba``: more ``pg_hba.conf`` lines, both
    servers'."""
    bindir = require_bindir()
    if not (bindir / "pg_basebackup").is_file():
        pytest.skip(f"no pg_basebackup in {bindir}")
    settings = {"wal_level": "replica", "max_wal_senders": "5", "wal_keep_size": "256MB"}
    if synchronous:
        settings["synchronous_standby_names"] = STANDBY_NAME
    primary = ThrowawayServer(bindir, settings=settings, listen=listen[0])
    standby: ThrowawayServer | None = None
    try:
        primary.init()
        for line in hba:  # (pg_basebackup copies them to the standby)
            primary.allow(line)
        primary.start()
        standby = _standby_of(primary, listen[1])
        made = Cluster(primary, standby, synchronous)
        if synchronous:  # the standby is attached as the synchronous one before any test write
            deadline = time.monotonic() + 30
            with psycopg.connect(primary.url(), autocommit=True) as pg:
                while pg.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name"
                                 " = %s AND sync_state = 'sync'", (STANDBY_NAME,)
                                 ).fetchone()[0] == 0:
                    if time.monotonic() > deadline:
                        raise AssertionError("the standby never became synchronous")
                    time.sleep(0.1)
        yield made
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()
        shutil.rmtree(primary.root, ignore_errors=True)
