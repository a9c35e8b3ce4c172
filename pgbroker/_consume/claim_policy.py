"""The claim policy: which queue a channel claims from next, how many, and whether it may find any.

One :class:`ClaimPolicy` per channel, followed by both consuming paths of
:class:`pgbroker._consume.consumer.Consumer`: the worker's event loop (one queue's claim per turn)
and ``drain_events`` (a whole round per call). It also says which statement claims a queue: a
queue is claimed by ``job_claim`` (the cheap one) until a claim finds it gated (keyed jobs, rate
limits: see ``sql/queries.sql``), then by ``job_claim_gated``; and where in the queue the claim
starts (its cursor: :class:`ClaimPolicy`, 0014_claim_cursor.sql). What a claim returns:
:mod:`pgbroker._model.claimed`.
"""

from __future__ import annotations

import logging
from time import monotonic
from typing import Any

from .._model.claimed import END, HEAD, Claimed, Delivery, JobRow, Position, position

__all__ = ["ClaimPolicy", "WAKE_COALESCE"]

#: Seconds wake-ups (NOTIFYs) of a channel are held together after one found nothing to claim.
WAKE_COALESCE = 0.05
#: Every how many polls the claims start from the head while NOTIFYs arrive (see polled).
RESCAN_POLLS = 6
#: Seconds claims wait after one failed on a living connection: doubling from the first to the
#: second, reset by a claim that runs.
FAILED_CLAIM_WAIT = (0.5, 30.0)

logger = logging.getLogger(__name__)

class ClaimPolicy:
    """One channel's claims, by the one policy of both paths (event loop and ``drain_events``).

    Which queue: a round over the channel's consumed queues, each round starting one queue
    further than the last (fairness). How many: the free prefetch slots, else
    ``claim_batch_max``. Whether a claim may find anything: a NOTIFY, a timer or a full batch
    said so (``more``). It also keeps the channel's deferred acks, sent with its next claim.

    Where a claim starts (the cursor, 0014_claim_cursor.sql): after the last row the queue's last
    claim took (a claim that took none leaves it where it was); never before a place a
    wake-up named since (:meth:`lower`), including one that arrived while the claim was in
    flight: its row may have committed after the claim's snapshot. Rows that become pending
    behind the cursor without a wake-up naming their place (a resume, an admin retry, a lost
    notification, a claim of another consumer rolled back) are found by the claims from the
    head that every poll and every wake-up without a place ask for (:meth:`rescan`). A gated
    queue is always claimed from the head: a keyed job passed over waits behind any cursor.
    """

    def __init__(self, batch_max: int):
        self.batch_max = batch_max
        self.more = True           # a claim may find something
        self.woken = False         # ... because a NOTIFY said so (see wake)
        self.quiet_until = 0.0     # wake-ups wait until then (see wake)
        self.held_wake = False     # one is waiting
        self.pending_acks: list[Delivery] = []  # deferred acks (see QoS.ack)
        self.no_ack: set[str] = set()  # queues consumed with no_ack: acked once handed over
        self._rotation = 0
        self._round: list[str] = []  # event loop: the queues still to claim from in this round
        self._gated: set[str] = set()  # the queues claimed by job_claim_gated (sticky)
        self._after: dict[str, Position] = {}  # a queue's cursor (absent: HEAD)
        #: the queue whose claim is in flight: the lowest place named since it was sent
        self._flight: dict[str, Position] = {}
        self._failed_wait = 0.0  # how long claims wait after this failure (see failed)
        self._polls = 0

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

    def after(self, queue: str) -> Position:
        """Where the next claim of ``queue`` starts."""
        return HEAD if queue in self._gated else self._after.get(queue, HEAD)

    def start(self, queue: str) -> Position:
        """Where a claim of ``queue`` about to be sent starts (see :meth:`took`)."""
        self._flight[queue] = END
        return self.after(queue)

    def took(self, queue: str, rows: list[JobRow], want: int) -> list[JobRow]:
        """The rows of a claim of ``queue``: moves its cursor past the last one, never past a
        place named meanwhile; learns whether the queue is gated. A claim that did not run
        (given up on a superseded connection: not a :class:`Claimed`) sends the next one to the
        head. (``want``: how many it asked for.)"""
        named = self._flight.pop(queue, END)
        if not isinstance(rows, Claimed):
            self.lower(queue, HEAD)
            return rows
        if rows.gated:
            self._gated.add(queue)
        if rows:
            self._after[queue] = min(position(rows[-1]), named)
        return rows

    def lower(self, queue: str, place: Position) -> None:
        """A wake-up says rows of ``queue`` are pending from ``place`` on (HEAD: anywhere)."""
        self._after[queue] = min(self._after.get(queue, HEAD), place)
        if queue in self._flight:
            self._flight[queue] = min(self._flight[queue], place)

    def polled(self, notified: bool) -> None:
        """The poll (``poll_interval``): claim again, from the head of each queue when due.
        While NOTIFYs arrive (``notified``) they name every place a row became pending, so the
        claim from the head -- whose cost grows with the dead row versions a held snapshot keeps
        -- is for what none named (a NOTIFY lost, a claim of another consumer rolled back) and
        runs every :data:`RESCAN_POLLS` polls; without them (transaction pooling: poll-only) at
        every poll."""
        self.more = True
        self._polls += 1
        if not notified or self._polls % RESCAN_POLLS == 0:
            self.rescan()

    def rescan(self) -> None:
        """The next claim of every queue starts from the head (the poll: see the class)."""
        for queue in list(self._after) + list(self._flight):
            self.lower(queue, HEAD)

    def take_acks(self) -> list[Delivery]:
        acks, self.pending_acks = self.pending_acks, []
        return acks

    def claimed(self, found: bool, full: bool) -> None:
        """After a claim (event loop) or a round of them (``drain_events``). A full batch means
        more may be waiting, in a new round; else a NOTIFY, a due timer or the poll says when."""
        if found:
            self.quiet_until = 0.0
            self._failed_wait = 0.0
        elif self.woken:
            self.quiet_until = monotonic() + WAKE_COALESCE
        self.woken = False
        if full:
            self.more = True
            self._round = []

    def failed(self, exc: Exception) -> float:
        """A claim failed on a living connection (a full disk, a statement timeout): no lost
        connection, so the consumer is not restarted. Claims wait (:data:`FAILED_CLAIM_WAIT`,
        doubling), then start again from the head; returns when (monotonic)."""
        first, most = FAILED_CLAIM_WAIT
        self._failed_wait = min(max(2 * self._failed_wait, first), most)
        logger.warning("pgbroker: a claim failed on a living connection (SQLSTATE %s: %s); "
                       "claims wait %ss", getattr(exc, "sqlstate", None),
                       (str(exc).strip() or type(exc).__name__).splitlines()[0],
                       self._failed_wait)
        self.quiet_until = monotonic() + self._failed_wait
        self.more, self.held_wake, self._round = False, True, []
        self.rescan()
        return self.quiet_until

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
