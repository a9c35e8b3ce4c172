"""The broker's statements: one :class:`Store` per broker connection.

Its statements are named blocks of ``sql/*.sql``, run through
:class:`pgbroker._pg.catalogue.Queries`; what a message to insert is, and how it becomes
parameters, is :mod:`pgbroker._model.job`. A store runs them on its
:class:`~pgbroker._pg.session.Session`: one psycopg connection in autocommit mode and the
policy every statement runs under. Every method is one statement, so one short transaction, and
the session serialises calls from several threads (an ack from a thread pool, a heartbeat
thread).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from .._model import stopping as _stopping
from .._model.claimed import EARLIEST, HEAD, Claimed, JobRow, Position, after_params, is_gate_marker
from .._model.job import (
    NewJob,
    batch_lists,
    log_duplicates,
    lookup_params,
    row_params,
    row_text_params,
)
from .._model.text import escape
from ..settings import Settings
from . import libpq as _pq
from . import outcomes as _outcomes
from .claim_retry import ClaimRetry, Step
from .retry import retried
from .session import POOLER_ERRORS, Session

__all__ = ["Store", "NewJob", "BROADCAST_TTL"]

#: Seconds after its end that a minute is rolled up (stats_rollup): rows are stamped with their
#: transaction's start, so a row stamped in a minute may commit a little after it.
ROLLUP_LAG = 10.0

logger = logging.getLogger(__name__)

#: Seconds a claim waits for the rows of the acks folded into it; another session's lock on one
#: of them (an open transaction in psql) must not hold up the consumer's claims.
CLAIM_LOCK_TIMEOUT = 0.2

#: Seconds a broadcast can be read (the sweeper prunes it then); a consumer remembers the ids it
#: delivered for twice as long, so that a replayed NOTIFY of one delivers nothing.
BROADCAST_TTL = 60.0

#: Seconds a maintenance statement (the sweeper's) waits for a lock before that step is skipped
#: until the next sweep: a lock held by another session must not hold up the lease's thread.
MAINTENANCE_LOCK_TIMEOUT = 1.0

#: Parameters of job_insert sent in binary format (bytea).
_BINARY_PARAMS = frozenset({"body", "message_digest"})

def _keep_locked(deliveries: list[tuple[uuid.UUID, int]],
                 locked: list[tuple[uuid.UUID, int]] | None, what: str) -> None:
    if not deliveries:
        return
    if locked is not None:
        locked.extend(deliveries)
    else:
        logger.warning("pgbroker: %d %s(s) not done: another session holds their rows locked "
                       "(the sweeper redelivers them once this consumer is gone)",
                       len(deliveries), what)


def _error(text: str | None) -> str | None:
    """An error or traceback as a text column holds it: escaped if it must be (NUL, lone
    surrogates: pgbroker._model.text), so recording a failure never fails for its text."""
    return None if text is None else escape(text)


class Store:
    """pgbroker's statements over one connection."""

    def __init__(self, conninfo: str, settings: Settings, *, application_name: str = "pgbroker"):
        self.conninfo = conninfo
        self.settings = settings
        self.session = Session(conninfo, settings, application_name=application_name)
        self.q = self.session.q
        self._execute = self.session.execute

    # -- the session's -----------------------------------------------------------------------

    @property
    def conn(self) -> psycopg.Connection[Any]:
        return self.session.conn

    @property
    def on_connect(self) -> list[Any]:
        """Called with every new connection (see :class:`Session`)."""
        return self.session.on_connect

    def connect(self) -> psycopg.Connection[Any]:
        return self.session.connect()

    def statement_lock(self) -> Any:
        return self.session.statement_lock()

    def close(self) -> None:
        self.session.close()

    # -- publish ---------------------------------------------------------------------------------

    def insert(self, job: NewJob) -> None:
        """One message: a statement prepared once per connection, with its parameters encoded
        here rather than by psycopg's adaptation (a quarter less client CPU per INSERT)."""
        params = row_text_params(job)
        params["channel"] = self.settings.channel.encode()
        if self.session.pooled:
            self._insert_unprepared(job)
            return
        with self.session.statement("job_insert", self.settings.durable_publish) as conn:
            pgconn = conn.pgconn
            try:
                names = self.session.prepared.get("job_insert")
                if names is None:
                    text, names = _pq.numbered(self.q["job_insert"])
                    _pq.prepare(pgconn, b"pgbroker_insert", text)
                    self.session.prepared["job_insert"] = names
                _pq.send(pgconn, b"pgbroker_insert", [params[n] for n in names],
                         [1 if n in _BINARY_PARAMS else 0 for n in names])
                results: list[Any] = []
                _pq.collect(pgconn, results, wait=True)
                for result in results:
                    _pq.check(result)
            except POOLER_ERRORS as exc:  # nothing was inserted: sent again, unprepared
                self.session.pooler_found(exc)
                self._insert_unprepared(job)
                return
        if not results[-1].ntuples:  # no NOTIFY: nothing was inserted
            self.duplicates([job])

    def _insert_unprepared(self, job: NewJob) -> None:
        """:meth:`insert` through a transaction pooler: one plain statement."""
        rows = self._execute("job_insert", {**row_params(job),
                                            "channel": self.settings.channel}).fetchall()
        if not rows:
            self.duplicates([job])

    def insert_dead(self, job: NewJob, error: str) -> None:
        """A message kept as a dead letter at once (``job_insert_dead``: unroutable)."""
        self._execute("job_insert_dead", {**row_params(job), "error": _error(error)})

    def insert_many(self, jobs: Sequence[NewJob]) -> None:
        if jobs:
            rows = self._execute("job_insert_many",
                                 batch_lists(jobs, self.settings.channel)).fetchall()
            skipped = {row[0] for row in rows if row[0] is not None}
            if skipped:
                self.duplicates([job for job in jobs if job.id in skipped])

    def duplicates(self, jobs: Sequence[NewJob]) -> None:
        """``jobs`` were skipped by the insert as duplicates: count them (pgbroker stats) and
        name the jobs they duplicate (DEBUG)."""
        found = self._execute("job_enqueued_ids", lookup_params(jobs)).fetchall()
        log_duplicates(jobs, found)

    # -- consume ---------------------------------------------------------------------------------

    def claim(self, queue: str, limit: int, consumer: uuid.UUID,
              acks: Iterable[tuple[uuid.UUID, int]] = (),
              locked: list[tuple[uuid.UUID, int]] | None = None,
              gated: bool = False, after: Position = HEAD) -> Claimed:
        """Take up to ``limit`` due jobs of ``queue``, acknowledging ``acks`` in the same
        statement (plain acks only: no deletion). An ack whose row another session holds
        locked would make the claim wait: after CLAIM_LOCK_TIMEOUT the claim is made again
        without the acks, which go to ``locked`` (for :meth:`ack`, which skips locked rows).
        ``gated``: by job_claim_gated (keys and rate limits); else by job_claim, and made again
        at once by job_claim_gated (without the acks: made) when that finds the queue gated.
        ``after``: job_claim takes the rows after this place (ClaimPolicy's cursor)."""
        ids, attempts = _pq.split(acks)
        params = {"queue": queue, "limit": limit, "consumer": consumer, "ids": ids,
                  "attempts": attempts, **after_params(after)}
        name = "job_claim_gated" if gated else "job_claim"
        retry = ClaimRetry()  # (a deadlock: about 1 in 15,000 claims with 4 busy consumers)
        while True:
            try:
                cur = self._execute(name, params, binary=True, durable=False,
                                    lock_timeout=CLAIM_LOCK_TIMEOUT if ids else None,
                                    rerun=False)
                rows = cur.fetchall()
            except psycopg.Error as exc:
                step = retry.step(exc, bool(ids))
                if step is Step.RAISE:
                    raise
                if step is Step.WITHOUT_ACKS:
                    _keep_locked(list(zip(ids, attempts)), locked, "ack")
                    ids, attempts = [], []
                    params.update(ids=ids, attempts=attempts)
                continue
            retry.done()
            if name == "job_claim" and rows and any(is_gate_marker(r) for r in rows):
                # the acks made: job_dead for those that ended dead, then the gated claim
                _outcomes.claimed([JobRow(*r) for r in rows if not is_gate_marker(r)])
                name, ids, attempts = "job_claim_gated", [], []
                params.update(ids=ids, attempts=attempts)
                continue
            break
        return Claimed.of(_outcomes.claimed([JobRow(*row) for row in rows]),
                          gated=name == "job_claim_gated")

    def promote(self, queues: Sequence[str], limit: int = 1000, after: datetime = EARLIEST,
                reached: list[datetime] | None = None) -> int:
        """Make the due scheduled jobs of ``queues`` with a run_at from ``after`` on pending;
        how many. ``reached``: gets where the next promotion may start (job_promote)."""
        row = self._execute("job_promote", {"queues": list(queues), "limit": limit,
                                            "channel": self.settings.channel, "after": after},
                            durable=False).fetchone()
        if reached is not None and row is not None and row[2] is not None:
            reached.append(row[2])
        return int(row[0]) if row else 0

    def next_due(self, queues: Sequence[str], after: datetime = EARLIEST) -> float | None:
        """Seconds (database clock) until the earliest scheduled job of ``queues`` (with a
        run_at from ``after`` on) is due."""
        row = self._execute("job_next_due", {"queues": list(queues), "after": after}).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def ack(self, deliveries: Iterable[tuple[uuid.UUID, int]], delete: bool = False,
            locked: list[tuple[uuid.UUID, int]] | None = None) -> int:
        """Complete deliveries; ``delete`` (transient messages, or retention 0) removes them.
        Returns how many were acked; those whose row another session holds locked go to
        ``locked``, to be acked later (see job_ack)."""
        ids, attempts = _pq.split(deliveries)
        if not ids:
            return 0
        name = "job_ack_delete" if delete or self.settings.retention == 0 else "job_ack"
        return len(self._settle(name, {"ids": ids, "attempts": attempts}, locked, "ack"))

    def requeue(self, deliveries: Iterable[tuple[uuid.UUID, int]],
                error: str | None = None,
                locked: list[tuple[uuid.UUID, int]] | None = None) -> int:
        """Give deliveries back. A requeue is no lost delivery: it cannot tell a pool process
        that died under its job from a task that raised ``Reject(requeue=True)``; the worker's
        request counts the first where Celery sees ``WorkerLostError``
        (pgbroker._celery.failures)."""
        ids, attempts = _pq.split(deliveries)
        if not ids:
            return 0
        done = self._settle("job_requeue", {"ids": ids, "attempts": attempts,
                                             "error": _error(error),
                                             "channel": self.settings.channel}, locked, "requeue")
        return len(done)

    def bury(self, job_id: uuid.UUID, attempt: int, error: str,
             locked: list[tuple[uuid.UUID, int]] | None = None) -> int:
        return len(self._settle("job_bury", {"id": job_id, "attempt": attempt,
                                             "error": _error(error)}, locked, "bury"))

    def _settle(self, name: str, params: dict[str, Any],
                locked: list[tuple[uuid.UUID, int]] | None, what: str
                ) -> list[tuple[uuid.UUID, int]]:
        """Run an ack, requeue or bury; returns the deliveries settled (those whose row another
        session holds locked go to ``locked``; the dead ones are signalled: _outcomes)."""
        rows = self._execute(name, params, durable=False).fetchall()
        _keep_locked([(r[0], r[1]) for r in rows if not r[2]], locked, what)
        return _outcomes.settled(rows)

    def fail(self, job_id: uuid.UUID, attempt: int, error: str, traceback: str | None) -> int:
        """Record that the task of this delivery raised, before its ack (it waits for the row's
        lock: pgbroker._celery.failures)."""
        rows = self._execute("job_fail", {"id": job_id, "attempt": attempt,
                                          "error": _error(error),
                                          "traceback": _error(traceback)}).fetchall()
        _outcomes.failed(job_id, rows)
        return len(rows)

    def record_ending(self, how: str, job_id: uuid.UUID, attempt: int, note: str) -> bool:
        """What Celery did with this delivery that only its worker sees (sql/endings.sql):
        ``how`` is "stopped" (a revoke carried out) or "retried" (its task sent a retry).
        Whether the delivery's row was found."""
        return bool(self._execute(f"job_{how}", {"id": job_id, "attempt": attempt,
                                                 "note": _error(note)}).rowcount)

    def record_losses(self, deliveries: Sequence[tuple[uuid.UUID, int]], via: str = "worker",
                      workers: Sequence[str] | None = None) -> None:
        """These deliveries were lost where the evidence points to their task: each killed its
        pool process (``workers`` None: Celery's WorkerLostError in this worker's main
        process), or went down with the whole worker on the host ``workers`` names, one per
        delivery, that had been told nothing (the sweeper). Counted towards pausing their
        task names (sql/tasks.sql). A pool process lost once this process was told to stop is
        the shutdown's doing, and counts for nothing (pgbroker._model.stopping). A statement that
        fails on a living connection is sent again (pgbroker._pg.retry, three tries: this may run
        on the event loop). Never raises: a loss not counted only delays a pause."""
        if not deliveries or not self.settings.pause_task_after:
            return
        if workers is None and _stopping.told():
            logger.info("pgbroker: %d delivery(ies) lost their pool process after this worker "
                        "was told to stop: not counted against their task", len(deliveries))
            return
        ids, attempts = _pq.split(deliveries)
        try:
            params = {"ids": ids, "attempts": attempts, "via": via,
                      "workers": list(workers) if workers is not None else [None] * len(ids),
                      "pause_after": self.settings.pause_task_after}
            _outcomes.paused(retried(
                lambda: self._execute("task_loss_record", params).fetchall(),
                f"counting {len(ids)} lost deliveries", tries=3, backoff=0.05))
        except Exception as exc:  # noqa: BLE001 - the requeue or rescue itself is done
            logger.warning("pgbroker: could not count %d lost deliveries: %s", len(ids), exc)

    # -- remote control (sql/revoke.sql) ---------------------------------------------------------

    def revoke(self, task_ids: Sequence[str], *, actor: str, reason: str,
               detail: dict[str, Any], broadcast: NewJob | None) -> list[tuple[Any, ...]]:
        """``job_revoke``: (task id, job id, state, changed) rows; see pgbroker._produce.revoke."""
        b = row_params(broadcast) if broadcast is not None else {}
        params = {"task_ids": list(task_ids), "actor": actor, "reason": reason,
                  "detail": Jsonb(detail), "channel": self.settings.channel,
                  **{f"b_{k}": b.get(k) for k in ("id", "exchange", "routing_key", "body",
                                                  "content_type", "content_encoding",
                                                  "headers", "properties")}}
        # (a deadlock with an ack or another revoke locking the same rows in another order is
        # sent again by _execute)
        return self._execute("job_revoke", params).fetchall()

    def scheduled(self, queues: Sequence[str], limit: int, body_max: int) -> list[tuple[Any, ...]]:
        """``job_scheduled_list``: the earliest scheduled jobs of ``queues``."""
        return self._execute("job_scheduled_list", {"queues": list(queues), "limit": limit,
                                                    "body_max": body_max}).fetchall()

    # -- queues ----------------------------------------------------------------------------------

    def declare_queue(self, name: str, arguments: dict[str, Any] | None = None,
                      durable: bool | None = None, auto_delete: bool | None = None) -> None:
        self._execute("queue_declare", {"name": name, "arguments": Jsonb(arguments or {}),
                                        "durable": durable, "auto_delete": auto_delete})

    def queue_exists(self, name: str) -> bool:
        row = self._execute("queue_exists", {"name": name}).fetchone()
        return bool(row and row[0])

    def queue_size(self, name: str) -> int:
        row = self._execute("queue_size", {"name": name}).fetchone()
        return int(row[0]) if row else 0

    def purge(self, name: str) -> int:
        row = self._execute("queue_purge", {"name": name}).fetchone()
        return int(row[0]) if row else 0

    def delete_queue(self, name: str) -> None:
        self._execute("queue_delete", {"name": name})

    # -- maintenance (the sweeper) ---------------------------------------------------------------

    # The sweeper's statements: ``now`` is the time the pass acts at (None: the database's).

    def rescue(self, lock_class: int, limit: int = 1000,
               now: datetime | None = None) -> tuple[int, int, int]:
        """Orphans back to pending (or dead), each a lost delivery; (requeued, dead, consumers)."""
        row = self._execute("job_rescue", {
            "lease": self.settings.lease_timeout, "lock_class": lock_class, "limit": limit,
            "channel": self.settings.channel, "now": now},
            lock_timeout=MAINTENANCE_LOCK_TIMEOUT).fetchone()
        assert row is not None
        # only the workers that were told nothing point to a task (0019_loss_evidence.sql)
        lost = [(d, host) for d, host in zip(_outcomes.rescued(row), row[7]) if host is not None]
        if lost:
            self.record_losses([d for d, _ in lost], via="sweeper",
                               workers=[host for _, host in lost])
        return int(row[0]), int(row[1]), int(row[2])

    def expire(self, limit: int = 1000, now: datetime | None = None) -> int:
        return self._execute("job_expire", {"limit": limit, "now": now},
                             lock_timeout=MAINTENANCE_LOCK_TIMEOUT).rowcount

    def promote_all(self, limit: int = 1000, now: datetime | None = None) -> int:
        row = self._execute("job_promote_all", {"limit": limit, "channel": self.settings.channel,
                                                "now": now},
                            lock_timeout=MAINTENANCE_LOCK_TIMEOUT).fetchone()
        return int(row[0]) if row else 0

    def prune(self, now: datetime | None = None) -> int:
        return self._execute("job_prune", {"retention": self.settings.retention,
                                           "limit": self.settings.prune_batch_size, "now": now},
                             lock_timeout=MAINTENANCE_LOCK_TIMEOUT).rowcount

    def rollup(self, minutes: int = 15) -> int:
        """Roll up to ``minutes`` closed minutes up for the admin page's charts, and sample the
        backlog once a minute (``stats_rollup`` in sql/admin.sql); returns the rows written.
        Nothing is written while another sweeper does it, or when nothing is due."""
        due = self._execute("stats_rollup_due", {"lag": ROLLUP_LAG},
                            lock_timeout=MAINTENANCE_LOCK_TIMEOUT).fetchone()
        if due is None or not due[0]:
            return 0
        params = {"lag": ROLLUP_LAG, "minutes": minutes,
                  "backfill": min(self.settings.retention, 86400.0)}
        with self.session.statement("stats_rollup", True, MAINTENANCE_LOCK_TIMEOUT) as conn, \
                conn.transaction():
            # Its estimates (a function over a range known only at run time) pass
            # jit_above_cost, and compiling took a second where running takes milliseconds.
            conn.execute("SET LOCAL jit = off")
            row = self.q.one(conn, "stats_rollup", params)
        return int(row[0]) + int(row[1])

    # -- exchanges, bindings, broadcasts ---------------------------------------------------------

    def declare_exchange(self, name: str, type: str, durable: bool, auto_delete: bool,
                         arguments: dict[str, Any] | None) -> None:
        self._execute("exchange_declare", {"name": name, "type": type, "durable": durable,
                                           "auto_delete": auto_delete,
                                           "arguments": Jsonb(arguments or {})})

    def exchange_type(self, name: str) -> str | None:
        row = self._execute("exchange_type", {"name": name}).fetchone()
        return row[0] if row else None

    def delete_exchange(self, name: str) -> None:
        self._execute("exchange_delete", {"name": name})

    def bind(self, exchange: str, routing_key: str, queue: str) -> None:
        self._execute("binding_declare", {"exchange": exchange, "routing_key": routing_key,
                                          "queue": queue})

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        self._execute("binding_delete", {"exchange": exchange, "routing_key": routing_key,
                                         "queue": queue})

    def bindings(self, exchange: str) -> list[tuple[str, str]]:
        """(routing key, queue) of every binding of ``exchange``."""
        return [(r[0], r[1]) for r in self._execute("binding_list", {"exchange": exchange})]

    def broadcast(self, job: NewJob, queues: Sequence[str] | None = None) -> None:
        """Write one message for every consumer bound to its exchange right now (of ``queues``
        only, if given); notify them."""
        headers, properties = job.jsonb()
        self._execute("broadcast_insert", {
            "id": job.id, "exchange": job.exchange, "routing_key": job.routing_key,
            "body": job.body, "content_type": job.content_type,
            "content_encoding": job.content_encoding, "headers": headers,
            "properties": properties, "channel": self.settings.channel,
            "queues": None if queues is None else list(queues)})

    def fanout(self, job: NewJob) -> None:
        """A message to the fanout exchange ``job.exchange``: a job in each bound queue that is
        not auto-delete, a broadcast for the others, in one statement (``job_fanout``)."""
        rows = self._execute("job_fanout", {**row_params(job),
                                            "channel": self.settings.channel}).fetchall()
        skipped = [row[0] for row in rows if row[0] is not None]
        if skipped:
            self.duplicates([dataclasses.replace(job, queue=queue) for queue in skipped])

    def fanout_queues(self, exchange: str) -> list[tuple[str, bool]]:
        """(queue, whether a fanout message is a job there) of every queue bound to
        ``exchange``."""
        return [(r[0], r[1]) for r in self._execute("fanout_queues", {"exchange": exchange})]

    def broadcast_get(self, broadcast_id: uuid.UUID, ttl: float) -> tuple[Any, ...] | None:
        """The broadcast, if it is younger than ``ttl`` seconds."""
        return self._execute("broadcast_get", {"id": broadcast_id, "ttl": ttl},
                             binary=True).fetchone()

    def prune_broadcasts(self, ttl: float = BROADCAST_TTL, limit: int = 1000,
                         now: datetime | None = None) -> int:
        return self._execute("broadcast_prune", {"ttl": ttl, "limit": limit, "now": now},
                             lock_timeout=MAINTENANCE_LOCK_TIMEOUT).rowcount

    def fold_duplicates(self, limit: int = 1000) -> int:
        """Fold the duplicate-publish counter rows into one per queue; returns the rows folded."""
        row = self._execute("publish_duplicates_fold", {"limit": limit},
                            lock_timeout=MAINTENANCE_LOCK_TIMEOUT).fetchone()
        return int(row[0]) if row else 0

    def prune_concurrency_keys(self, limit: int = 1000, now: datetime | None = None) -> int:
        """Delete the rows of concurrency keys idle for an hour; returns how many."""
        return self._execute("concurrency_keys_prune", {"limit": limit, "now": now},
                             lock_timeout=MAINTENANCE_LOCK_TIMEOUT).rowcount

    def expire_queues(self, limit: int = 100, now: datetime | None = None) -> int:
        return self._execute("queue_expire", {"limit": limit, "now": now},
                             lock_timeout=MAINTENANCE_LOCK_TIMEOUT).rowcount

    # -- consumers -------------------------------------------------------------------------------

    def register_consumer(self, consumer: uuid.UUID, queues: Sequence[str],
                          lock_key: int | None) -> None:
        self._execute("consumer_register", {
            "id": consumer, "host": socket.gethostname(), "pid": os.getpid(),
            "queues": list(queues), "lock_key": lock_key, "lease": self.settings.lease_timeout})

    def heartbeat(self, consumer: uuid.UUID, queues: Sequence[str],
                  failing_for: float | None = None, settle_error: str | None = None) -> bool:
        """Renew the lease; False when the consumer was declared gone (its jobs rescued).
        ``failing_for``/``settle_error``: its settling statements fail
        (pgbroker._consume.settle)."""
        return self._execute("consumer_heartbeat", {
            "id": consumer, "queues": list(queues), "failing_for": failing_for,
            "settle_error": settle_error}).rowcount == 1

    def autovacuum_on(self) -> bool:
        """Whether autovacuum vacuums ``jobs`` (see docs/operations.md, "Vacuum")."""
        row = self._execute("jobs_autovacuum").fetchone()
        return bool(row and row[0])

    def unregister_consumer(self, consumer: uuid.UUID) -> None:
        self._execute("consumer_unregister", {"id": consumer})

    def mark_stopping(self) -> int:
        """This process's consumers were told to stop (consumer_stopping); how many."""
        return self._execute("consumer_stopping", {"host": socket.gethostname(),
                                                   "pid": os.getpid()}).rowcount
