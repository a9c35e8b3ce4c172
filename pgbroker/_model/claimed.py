"""What a claim is about: a place in a queue's claim order (:data:`Position`), a claimed row
(:class:`JobRow`), a claim's rows in delivery order (:class:`Claimed`), and what a wake-up names.
No I/O: the store reads rows into these, the claim policy and the consumer follow them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = ["Claimed", "Delivery", "EARLIEST", "END", "HEAD", "JobRow", "Position", "after_params",
           "is_gate_marker", "parse_wake", "position"]

Delivery = tuple[uuid.UUID, int]

#: A place in a queue's claim order, jobs_claim_idx's (-priority, run_at, id): a claim takes the
#: rows after it (0014_claim_cursor.sql).
Position = tuple[int, datetime, uuid.UUID]
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: The first run_at: a promotion of scheduled jobs from the first one (job_promote's cursor).
EARLIEST = datetime.min.replace(tzinfo=timezone.utc)
#: Before every row: a claim from the head of the queue.
HEAD: Position = (-256, EARLIEST, uuid.UUID(int=0))
#: After every row: the place named to a claim in flight while no wake-up has named one.
END: Position = (256, datetime.max.replace(tzinfo=timezone.utc), uuid.UUID(int=2**128 - 1))


def after_params(after: Position = HEAD) -> dict[str, Any]:
    """job_claim's parameters for a claim of the rows after ``after`` (HEAD: all)."""
    return {"after_priority": after[0], "after_run_at": after[1], "after_id": after[2]}


def parse_wake(kind: str) -> tuple[float, Position] | None:
    """A wake-up's delay and the place it names, from its payload's first word:
    '<delay>,<priority>,<run_at in microseconds>' (``jobs_wake_payload``), the place just before
    every row of that priority and run_at; '<delay>' (an older pgbroker, a resume, an admin
    retry) names none: HEAD. None: not a wake-up (anyone can NOTIFY)."""
    delay, *place = kind.split(",")
    try:
        if not place:
            return float(delay), HEAD
        priority, run_at_us = place
        # (the priority kept in the column's range: a spoofed one must not break the claim)
        return float(delay), (-min(max(int(priority), 0), 255),
                              _EPOCH + timedelta(microseconds=int(run_at_us)), uuid.UUID(int=0))
    except (ValueError, OverflowError):
        return None


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


class Claimed(list[JobRow]):
    """The rows of a claim, in delivery order. ``gated``: job_claim found the queue gated (its
    marker row) and the claim was made again by job_claim_gated: claim it with that from now on
    (:class:`pgbroker._consume.claim_policy.ClaimPolicy`)."""

    gated = False

    @classmethod
    def of(cls, rows: Iterable[Any], gated: bool = False) -> Claimed:
        claimed = cls(sorted(rows, key=position))
        claimed.gated = gated
        return claimed


def position(row: JobRow) -> Position:
    """A claimed row's place in its queue's claim order."""
    return (-row.priority, row.run_at, row.id)


def is_gate_marker(row: Sequence[Any]) -> bool:
    """job_claim's marker row (id NULL): the queue is gated, see job_claim."""
    return row[0] is None
