"""The claim policy: which queue a channel claims from next, how many, and whether it may find any.

One :class:`ClaimPolicy` per channel, followed by both consuming paths of
:class:`pgbroker._consumer.Consumer`: the worker's event loop (one queue's claim per turn) and
``drain_events`` (a whole round per call). It also says which statement claims a queue: a
queue is claimed by ``job_claim`` (the cheap one) until a claim finds it gated (keyed jobs, rate
limits: see ``sql/queries.sql``), then by ``job_claim_gated``. What a claim returns: its rows
(:class:`JobRow`), in delivery order (:class:`Claimed`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from time import monotonic
from typing import Any

__all__ = ["ClaimPolicy", "Claimed", "Delivery", "JobRow", "WAKE_COALESCE", "is_gate_marker"]

#: Seconds wake-ups (NOTIFYs) of a channel are held together after one found nothing to claim.
WAKE_COALESCE = 0.05

Delivery = tuple[uuid.UUID, int]


@dataclass(frozen=True, slots=True)
class JobRow:
    """A claimed delivery."""

    id: uuid.UUID
    queue: str
    attempt: int
    priority: int
    run_at: datetime
    exchange: str
    routing_key: str
    body: bytes
    content_type: str | None
    content_encoding: str | None
    headers: Any
    properties: Any
    #: 'running'; 'dead' for an ack folded into the claim that ended its job dead (_outcomes)
    state: str = "running"
    task: str | None = None
    last_error: str | None = None


class Claimed(list):  # type: ignore[type-arg]
    """The rows of a claim, in delivery order. ``gated``: job_claim found the queue gated (its
    marker row) and the claim was made again by job_claim_gated: claim it with that from now on
    (:class:`pgbroker._claims.ClaimPolicy`)."""

    gated = False

    @classmethod
    def of(cls, rows: Iterable[Any], gated: bool = False) -> Claimed:
        claimed = cls(sorted(rows, key=lambda r: (-r.priority, r.run_at, r.id)))
        claimed.gated = gated
        return claimed


def is_gate_marker(row: Sequence[Any]) -> bool:
    """job_claim's marker row (id NULL): the queue is gated, see job_claim."""
    return row[0] is None


class ClaimPolicy:
    """One channel's claims, by the one policy of both paths (event loop and ``drain_events``).

    Which queue: a round over the channel's consumed queues, each round starting one queue
    further than the last (fairness). How many: the free prefetch slots, else
    ``claim_batch_max``. Whether a claim may find anything: a NOTIFY, a timer or a full batch
    said so (``more``). It also keeps the channel's deferred acks, sent with its next claim.
    """

    def __init__(self, batch_max: int):
        self.batch_max = batch_max
        self.more = True           # a claim may find something
        self.woken = False         # ... because a NOTIFY said so (see wake)
        self.quiet_until = 0.0     # wake-ups wait until then (see wake)
        self.held_wake = False     # one is waiting
        self.pending_acks: list[Delivery] = []  # deferred acks (see QoS.ack)
        self._rotation = 0
        self._round: list[str] = []  # event loop: the queues still to claim from in this round
        self._gated: set[str] = set()  # the queues claimed by job_claim_gated (sticky)

    def may_find(self, queues: list[str]) -> bool:
        """Event loop: a claim is worth sending (something may be there, or the round goes on)."""
        return bool((self.more or self._round) and queues)

    def batch(self, qos: Any) -> int:
        """How many to claim: the free prefetch slots (none set: ``claim_batch_max``)."""
        return qos.can_consume_max_estimate() or self.batch_max

    def round(self, queues: list[str]) -> list[str]:
        """A new round: every queue, starting one further than the last round did."""
        self._rotation = (self._rotation + 1) % len(queues)
        return queues[self._rotation:] + queues[:self._rotation]

    def next_queue(self, queues: list[str]) -> str:
        """Event loop: the next queue of this round. A new round takes ``more``: a NOTIFY or a
        full batch sets it again."""
        self._round = [q for q in self._round if q in queues]
        if not self._round:
            self._round = self.round(queues)
            self.more = False
        return self._round.pop(0)

    def gated(self, queue: str) -> bool:
        """Whether ``queue`` is claimed by job_claim_gated: since a claim found it gated (a
        queue's gate is never lifted in the database either)."""
        return queue in self._gated

    def took(self, queue: str, rows: Claimed) -> Claimed:
        """The rows of a claim of ``queue``: learns whether the queue is gated."""
        if rows.gated:
            self._gated.add(queue)
        return rows

    def take_acks(self) -> list[Delivery]:
        acks, self.pending_acks = self.pending_acks, []
        return acks

    def claimed(self, found: bool, full: bool) -> None:
        """After a claim (event loop) or a round of them (``drain_events``). A full batch means
        more may be waiting, in a new round; else a NOTIFY, a due timer or the poll says when."""
        if found:
            self.quiet_until = 0.0
        elif self.woken:
            self.quiet_until = monotonic() + WAKE_COALESCE
        self.woken = False
        if full:
            self.more = True
            self._round = []

    def wake(self) -> bool:
        """A NOTIFY says a job is due in a consumed queue: claim. Any role that can connect can
        send one, so after a claim woken this way found nothing, the next wake-up waits for the
        end of WAKE_COALESCE: a flood of them costs one claim per window, not one each (a real
        job then waits that long at most). False: held until ``quiet_until``."""
        if monotonic() >= self.quiet_until:
            self.more = True
            self.woken = True
            self.held_wake = False
            return True
        self.held_wake = True
        return False
