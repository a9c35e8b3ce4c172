"""One connection of pgbroker's and the policy every statement on it runs under.

A :class:`Session` owns one psycopg connection in autocommit mode and decides, for each
statement: a connection opened again after a fork or a failover (never the parent's session),
the schema migrated or checked at connect, generic plans (``plan_cache_mode``), dropped every
:data:`REPLAN_SECONDS`; ``synchronous_commit`` per statement (bookkeeping may skip the WAL
flush, publishes wait for it unless ``durable_publish`` is off); ``lock_timeout`` per statement;
a transaction pooler found at the first prepared statement it broke, and from then on nothing
prepared and no session settings; a deadlock or a moved row sent again
(:data:`pgbroker._pg.driver.RERUN_ERRORS`). :class:`pgbroker._pg.store.Store` runs pgbroker's
named statements through one; the event loop's statements on the LISTEN connection
(:mod:`pgbroker._consume.turn`) run under a :class:`Policy` of their own, the session's rules.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from time import monotonic
from typing import Any

import psycopg

from .._model.text import register_jsonb_loaders
from ..migrate import connect_ready
from ..settings import Settings
from . import driver as _db
from .catalogue import Queries

__all__ = ["POOLER_ERRORS", "REPLAN_SECONDS", "Policy", "Session"]

logger = logging.getLogger(__name__)

#: Seconds a prepared statement's plan is kept (then ``DISCARD PLANS``). PostgreSQL replans a
#: cached plan only after an ANALYZE or a schema change; a plan made while ``jobs`` was nearly
#: empty (a new schema, before autovacuum's first ANALYZE, or with autovacuum off) reads the
#: whole table on every claim once it has grown: 80 tasks/s instead of 1,100 at 65,000 rows.
#: Planned again, the same statement uses the indexes, as the planner sees the table's size.
REPLAN_SECONDS = 10.0

#: What a transaction pooler does to prepared statements: the next transaction runs on another
#: server session, which lacks the statement (or has another client's of the same name).
POOLER_ERRORS = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)

#: Statements that create messages: durable unless the user opts into fast publishing.
_PUBLISHES = frozenset({"job_insert", "job_insert_many", "job_fanout", "broadcast_insert"})


class Policy:
    """What one connection's statements run under, and what was last set on it.

    A :class:`Session` keeps one for its connection; the event loop's claims and acks on the
    LISTEN connection (:class:`pgbroker._consume.turn.LoopStatements`) keep their own, as they
    send their statements through libpq (``run``: how to run one SQL command on it now)."""

    def __init__(self, settings: Settings):
        #: through a transaction pooler: no session settings, nothing prepared
        self.pooled = settings.transaction_pooling
        self._sync: bool | None = None  # the connection's synchronous_commit, as last set
        self._lock_timeout: float | None = None  # its lock_timeout as last set (None: its own)
        self._replan_at = 0.0  # when the plans of its prepared statements go (REPLAN_SECONDS)

    def setup(self, conn: psycopg.Connection[Any]) -> None:
        """A new connection: generic plans (or, pooled, nothing prepared: a session setting
        would stay on a server session of other clients), nothing else set yet."""
        self._sync = self._lock_timeout = None
        self._replan_at = monotonic() + REPLAN_SECONDS
        if self.pooled:
            conn.prepare_threshold = None
        else:
            conn.execute("SET plan_cache_mode = force_generic_plan")

    def before(self, run: Callable[[str], object], sync: bool,
               lock_timeout: float | None = None) -> None:
        """Before every statement: drop the cached plans when they are due (``REPLAN_SECONDS``;
        the statements stay prepared), and set ``synchronous_commit`` and ``lock_timeout`` for
        this statement (each only when it changes). Through a transaction pooler, none of it:
        the server's own settings apply."""
        if self.pooled:
            return
        if monotonic() >= self._replan_at:
            run("DISCARD PLANS")
            self._replan_at = monotonic() + REPLAN_SECONDS
        if self._sync is not sync:
            run("SET synchronous_commit = " + ("on" if sync else "off"))
            self._sync = sync
        if self._lock_timeout != lock_timeout:
            run("RESET lock_timeout" if lock_timeout is None
                else f"SET lock_timeout = {int(lock_timeout * 1000)}")
            self._lock_timeout = lock_timeout


class Session:
    """One connection and its statement policy (see the module docstring)."""

    def __init__(self, conninfo: str, settings: Settings, *, application_name: str = "pgbroker",
                 setup: Callable[[psycopg.Connection[Any]], object] | None = None):
        self.conninfo = conninfo
        self.settings = settings
        self.q = Queries(settings.schema)
        self._application_name = application_name
        self._setup = setup  # the owner's own settings of a new connection (beat's)
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._exec_lock = threading.RLock()
        self.policy = Policy(settings)
        #: statements prepared on it by name, with their parameters' names
        self.prepared: dict[str, list[str]] = {}
        self._pid = os.getpid()
        #: called with every new connection, under the session's lock (a lease takes its advisory
        #: lock again: it went with the old session)
        self.on_connect: list[Any] = []

    # -- the connection ----------------------------------------------------------------------------

    def connect(self) -> psycopg.Connection[Any]:
        """Open the connection (migrating or checking the schema first); idempotent."""
        self._check_fork()
        with self._lock:
            if _db.owned(self._conn) and not _db.superseded(self._conn):
                assert self._conn is not None
                return self._conn
            _db.close(self._conn)  # on the old primary (superseded); else a no-op
            self._conn = None  # inherited through fork, or closed: never reuse
            # psycopg prepares a statement at its 5th execution; PostgreSQL would then still
            # plan it anew on every execution (its custom plans look cheaper), which was 40 %
            # of a claim. Every statement here is written for its generic plan, and the
            # claim's is asserted in tests/bench/test_query_plans.py.
            conn = connect_ready(
                self.conninfo, self.settings, application_name=self._application_name,
                what="checking the pgbroker schema", setup=self._session_setup)
            register_jsonb_loaders(conn)  # claimed rows: unescaped, and one bad row alone
            for hook in list(self.on_connect):
                hook(conn)
            self._conn = conn
            self.prepared = {}
            return conn

    def _session_setup(self, conn: psycopg.Connection[Any]) -> None:
        self.policy.setup(conn)
        if self._setup is not None:
            self._setup(conn)

    @property
    def pooled(self) -> bool:
        """Through a transaction pooler: said (``transaction_pooling``) or found at the first
        statement it broke (:meth:`pooler_found`)."""
        return self.policy.pooled

    def pooler_found(self, exc: BaseException) -> None:
        """A prepared statement went missing, or was there already: a transaction pooler hands
        this connection a different server session per transaction. From now on: nothing
        prepared, no session settings (the failed statement did not run: it is sent again)."""
        if not self.pooled:
            logger.warning("pgbroker: %s -- the connection goes through a transaction pooler "
                           "(PgBouncer?); statements are no longer prepared on it (set the "
                           "transport option transaction_pooling: True to say so)",
                           str(exc).strip().splitlines()[0])
        self.policy.pooled = True
        if self._conn is not None and not self._conn.closed:
            self._conn.prepare_threshold = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if (conn is None or conn.closed or getattr(conn, "_pgbroker_pid", None) != os.getpid()
                or _db.superseded(conn)):
            return self.connect()
        return conn

    def _check_fork(self) -> None:
        """In a forked child: new locks (a parent thread may have held them at the fork) and
        no connection (the parent's session is not ours to use or close)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._exec_lock = threading.RLock()
            self.on_connect = []  # the parent's leases are not this process's
            self._conn = None

    def statement_lock(self) -> Any:  # held to run statements on .conn directly (re-entrant)
        self._check_fork()
        return self._exec_lock

    def close(self) -> None:
        self._check_fork()
        with self._lock:
            _db.close(self._conn)
            self._conn = None

    def execute(self, name: str, params: dict[str, Any] | None = None, binary: bool = False,
                 durable: bool = True, lock_timeout: float | None = None,
                 rerun: bool = True, what: str | None = None) -> psycopg.Cursor[Any]:
        """Run a named query. ``durable=False`` marks consumer bookkeeping (claim, ack,
        requeue), which commits without waiting for the WAL flush unless ``durable_acks``.
        ``lock_timeout``: seconds the statement may wait for a lock, longer raises
        ``psycopg.errors.LockNotAvailable``; None: the connection's own setting (the URL's
        ``options``, else PostgreSQL's default: no limit). ``rerun=False``: a deadlock or a
        moved row is the caller's to send again (the claim's :class:`ClaimRetry`). ``what``:
        the statement as its errors name it (default: ``pgbroker <name>``)."""
        sync = self.settings.durable_acks if not durable else (
            self.settings.durable_publish if name in _PUBLISHES else True)
        self._check_fork()
        with self._exec_lock, _db.translate_errors(what or f"pgbroker {name}"):
            conn = self.conn
            self.policy.before(conn.execute, sync, lock_timeout)
            tries = 1
            while True:
                try:
                    return self.q.execute(conn, name, params, binary=binary)
                except POOLER_ERRORS as exc:
                    self.pooler_found(exc)
                    return self.q.execute(conn, name, params, binary=binary)
                except _db.RERUN_ERRORS:
                    # rolled back whole: sent again, unless it ran in a transaction of the
                    # caller's (then the caller's to handle)
                    if not rerun or tries == _db.RERUN_TRIES \
                            or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                        raise
                    tries += 1

    @contextlib.contextmanager
    def statement(self, name: str, sync: bool, lock_timeout: float | None = None
                  ) -> Iterator[psycopg.Connection[Any]]:
        """The connection, for a statement run on it directly (a prepared one of the caller's,
        a transaction): under the session's lock, its errors translated, its settings made."""
        self._check_fork()
        with self._exec_lock, _db.translate_errors(f"pgbroker {name}"):
            conn = self.conn
            self.policy.before(conn.execute, sync, lock_timeout)
            yield conn
