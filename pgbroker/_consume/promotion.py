"""Scheduled jobs of the consumed queues made pending when they are due (``job_promote``).

A job published with an eta waits as ``scheduled``; the consumer that consumes its queue
promotes it once it is due. :class:`Promotion` keeps the one :class:`Timer` for the earliest due
time known, moved earlier by a NOTIFY of a job scheduled sooner (its delay was measured at
INSERT, not COMMIT: the database clock is asked once per loop turn, however many arrived) and
checked at every poll, the fallback for lost notifications. It remembers where the last promotion
stopped (job_promote walks the scheduled rows in order): a NOTIFY of a job behind it, and the
poll, move it back.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import Any

from .._model.claimed import EARLIEST
from .._pg.store import Store
from .claim_policy import WAKE_COALESCE
from .timer import Timer

__all__ = ["Promotion"]

#: Seconds before a due time reached but not promoted (the statement's LIMIT, or a race) is
#: tried again.
AGAIN = 0.005


class Promotion:
    """The consumer's promotion of due jobs (see the module docstring): ``queues`` says which
    queues are consumed, ``found`` is called when jobs became pending, ``wake_at`` holds a
    refresh back that came too soon after the last one."""

    def __init__(self, store: Store, queues: Callable[[], list[str]], found: Callable[[], None],
                 wake_at: Callable[[float], None]):
        self._store = store
        self._queues = queues
        self._found = found
        self._wake_at = wake_at
        self.timer = Timer(self.run)
        self._to: Any = EARLIEST  # where the next promotion starts
        self._dirty = False  # a scheduled job was published: ask for the next due time
        self._checked_at = 0.0  # when refresh last asked the database

    def schedule(self, delay: float | None) -> None:
        """Run in ``delay`` seconds (earliest wins); None: nothing is due."""
        if delay is not None:
            self.timer.at_latest(monotonic() + max(delay, 0.0))

    def consumed(self, queue: str) -> None:
        """``queue`` is consumed from now on: its next due job."""
        self.schedule(self._store.next_due([queue], self._to))

    def notified(self, run_at: Any) -> None:
        """A job was scheduled for ``run_at``: the due time is asked at the next refresh."""
        self._dirty = True
        self._to = min(self._to, run_at)

    def run(self) -> None:
        """Promote what is due now, and arm the timer for the next due time."""
        queues = self._queues()
        if not queues:
            return
        reached: list[Any] = []
        if self._store.promote(queues, after=self._to, reached=reached):
            self._found()
        self._to = reached[0] if reached else EARLIEST
        delay = self._store.next_due(queues, self._to)
        self.schedule(None if delay is None else max(delay, AGAIN))

    def refresh(self) -> None:
        """Once per loop turn: the next due time, when a NOTIFY said one was scheduled."""
        if not self._dirty:
            return
        if monotonic() - self._checked_at < WAKE_COALESCE:  # spoofed ones: see ClaimPolicy.wake
            self._wake_at(self._checked_at + WAKE_COALESCE)
            return
        self._dirty = False
        self._checked_at = monotonic()
        queues = self._queues()
        if queues:
            self.schedule(self._store.next_due(queues, self._to))

    def poll(self) -> None:
        """The poll (the fallback for lost notifications): from the earliest, now."""
        self._to = EARLIEST
        if self._queues():
            self.timer.fire()
