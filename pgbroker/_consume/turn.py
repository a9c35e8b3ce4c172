"""The event loop's statements: claims and acks sent on the LISTEN connection without waiting.

:class:`LoopStatements` prepares ``job_claim``, ``job_claim_gated`` and ``job_ack`` once on the
consumer's LISTEN connection (:mod:`pgbroker._consume.consumer` owns it) and sends them through
:mod:`pgbroker._pg.libpq`; the loop reads their rows when the socket says they are there. Its
plan and commit settings are the session's (:mod:`pgbroker._pg.session`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.adapt import Transformer

from .._model.claimed import HEAD, Claimed, JobRow, Position, is_gate_marker
from .._model.text import register_jsonb_loaders
from .._pg import driver as _db
from .._pg import libpq as _pq
from .._pg import outcomes as _outcomes
from .._pg import session as _session
from .._pg.catalogue import queries
from .._pg.claim_retry import ClaimRetry, Step
from .._pg.store import CLAIM_LOCK_TIMEOUT
from ..settings import Settings

__all__ = ["LoopStatements"]


class LoopStatements:
    """Claims and acks that the worker's event loop sends without waiting for them.

    They run on the consumer's LISTEN connection, whose socket the loop watches anyway: a claim
    (with the deferred acks folded in) is sent and the loop goes on handing tasks to the pool and
    reading their results while PostgreSQL works; the rows are read when the socket says they
    are there. A blocking claim kept the loop waiting for most of every task's time. One
    statement is in flight at a time; only the loop's thread uses this connection.
    """

    _STATEMENTS = {b"pgbroker_claim": "job_claim", b"pgbroker_claim_gated": "job_claim_gated",
                   b"pgbroker_ack": "job_ack"}
    _TYPES = {"queue": 25, "limit": 23, "consumer": 2950, "ids": 2951, "attempts": 1007,
              "after_priority": 21, "after_run_at": 1184, "after_id": 2950}

    def __init__(self, conn: psycopg.Connection[Any], settings: Settings):
        self._conn = conn
        self._pgconn = conn.pgconn
        self._order: dict[bytes, list[str]] = {}
        #: through a transaction pooler: no session state, so each statement is sent whole
        #: (text and types) and the server's own settings apply (acks then wait for the flush)
        self._texts: dict[bytes, bytes] | None = {} if settings.transaction_pooling else None
        q = queries(settings.schema)
        #: the session's rules for this connection's statements: consumer bookkeeping, whose
        #: commit waits for the flush only with durable_acks. A claim waits for a row lock
        #: only on the rows of the acks folded into it (its candidates are SKIP LOCKED): one
        #: that meets a lock is sent again without its acks (as in Store.claim); one waiting
        #: for a table lock is sent again as it was.
        self._policy = _session.Policy(settings)
        self._sync = settings.durable_acks
        with _db.translate_errors("preparing the claim"):
            self._policy.setup(conn)
            for name, key in self._STATEMENTS.items():
                text, self._order[name] = _pq.numbered(q[key])
                if self._texts is not None:
                    self._texts[name] = text
                else:
                    _pq.prepare(self._pgconn, name, text,
                                [self._TYPES[n] for n in self._order[name]])
        register_jsonb_loaders(conn)  # as in Store.connect
        self._tx = Transformer(conn)
        self._sent: tuple[bytes, list[bytes], list[tuple[uuid.UUID, int]]] | None = None
        self._results: list[Any] = []
        self._retry = ClaimRetry()  # what the statement in flight does when it fails
        #: acks that met a row lock of another session: see take_locked
        self._locked: list[tuple[uuid.UUID, int]] = []

    def _command(self, command: str) -> None:  # a setting of the policy's, between statements
        _pq.run(self._pgconn, command.encode())

    @property
    def busy(self) -> bool:
        return self._sent is not None

    def send_claim(self, queue: str, limit: int, consumer: uuid.UUID,
                   acks: Sequence[tuple[uuid.UUID, int]], gated: bool = False,
                   after: Position = HEAD) -> None:
        """As Store.claim: ``gated`` by job_claim_gated, else by job_claim (the rows after
        ``after``), sent again by job_claim_gated (without the acks: made) when that finds the
        queue gated."""
        ids, attempts = _pq.text_arrays(acks)
        name = b"pgbroker_claim_gated" if gated else b"pgbroker_claim"
        self._send(name, {"queue": queue.encode(), "limit": b"%d" % limit,
                          "consumer": str(consumer).encode(), "ids": ids, "attempts": attempts,
                          "after_priority": b"%d" % after[0],
                          "after_run_at": after[1].isoformat().encode(),
                          "after_id": str(after[2]).encode()}, list(acks))

    def send_ack(self, acks: Sequence[tuple[uuid.UUID, int]]) -> None:
        ids, attempts = _pq.text_arrays(acks)
        self._send(b"pgbroker_ack", {"ids": ids, "attempts": attempts}, list(acks))

    def take_locked(self) -> list[tuple[uuid.UUID, int]]:
        """The acks not made: of finished statements that met another session's row lock, or
        of one given up on a superseded connection (:meth:`result`); to be acked later with
        job_ack (which skips locked rows), never folded into a claim again."""
        locked, self._locked = self._locked, []
        return locked

    def _without_acks(self, name: bytes, values: list[bytes]) -> list[bytes]:
        ids, attempts = _pq.text_arrays([])
        order = self._order[name]
        values = list(values)
        values[order.index("ids")], values[order.index("attempts")] = ids, attempts
        return values

    def _send(self, name: bytes, params: dict[str, bytes] | list[bytes],
              acks: list[tuple[uuid.UUID, int]]) -> None:
        assert self._sent is None, "a statement is in flight already"
        values = params if isinstance(params, list) else [params[n] for n in self._order[name]]
        with _db.translate_errors(f"pgbroker {self._STATEMENTS[name]}"):
            if self._texts is not None:
                _pq.send(self._pgconn, name, values, result_format=psycopg.pq.Format.BINARY,
                         text=self._texts[name],
                         types=[self._TYPES[n] for n in self._order[name]])
            else:
                self._policy.before(self._command, self._sync, CLAIM_LOCK_TIMEOUT)
                _pq.send(self._pgconn, name, values, result_format=psycopg.pq.Format.BINARY)
        self._sent = (name, values, acks)

    def result(self, wait: bool = False) -> list[JobRow] | None:  # Claimed for a claim
        """The claimed rows (none for an ack) once the statement in flight has finished; None
        while it runs (or without one). The caller has read the socket (``consume_input``).
        Never waited for on a connection left on a failover's old primary (``_db.superseded``),
        whose address may be dark: [] at once, its claim's rows come back with the lease, and
        its acks, made there or not, are to be made again (:meth:`take_locked`): job_ack by
        (id, attempt) completes a delivery at most once."""
        if wait and self._sent is not None and _db.superseded(self._conn):
            self._locked.extend(self._sent[2])
            self._sent, self._results = None, []
            return []
        pg = self._pgconn
        while self._sent is not None:
            name, values, acks = self._sent
            with _db.translate_errors(f"pgbroker {self._STATEMENTS[name]}"):
                if not _pq.collect(pg, self._results, wait):
                    return None
            self._sent = None
            (res,), self._results = self._results, []
            if res.status == psycopg.pq.ExecStatus.FATAL_ERROR:
                error = psycopg.errors.error_from_result(res)
                step = self._retry.step(error, bool(acks), claim=name != b"pgbroker_ack")
                if step is Step.RAISE:
                    self._retry.done()
                    raise error
                if step is Step.WITHOUT_ACKS:  # (they go to job_ack: see take_locked)
                    self._locked.extend(acks)
                    if name == b"pgbroker_ack":
                        self._retry.done()
                        return []
                    values, acks = self._without_acks(name, values), []
                self._send(name, values, acks)
                continue
            self._retry.done()
            self._tx.set_pgresult(res)
            if name == b"pgbroker_ack":  # job_ack: (id, attempt, done, state, task, error)
                done = self._tx.load_rows(0, res.ntuples, tuple)
                self._locked.extend((row[0], row[1]) for row in done if not row[2])
                _outcomes.settled(done)
                return []
            rows = self._tx.load_rows(0, res.ntuples, tuple)
            if name == b"pgbroker_claim" and any(is_gate_marker(r) for r in rows):
                # the queue is gated: the same claim by job_claim_gated, its acks made
                _outcomes.claimed([JobRow(*r) for r in rows if not is_gate_marker(r)])
                gated = b"pgbroker_claim_gated"
                by_name = dict(zip(self._order[name], self._without_acks(name, values)))
                self._send(gated, [by_name[n] for n in self._order[gated]], [])
                continue
            return Claimed.of(_outcomes.claimed([JobRow(*r) for r in rows]),
                              gated=name == b"pgbroker_claim_gated")
        return None
