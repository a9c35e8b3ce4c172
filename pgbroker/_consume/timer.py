"""One wake-up of the consumer's, earliest wins, on either of its two paths.

In a worker's event loop a :class:`Timer` is an entry in the loop's timers (kombu's hub
``call_later``); on the synchronous path (``drain_events``, no loop) it is a time that the drain
checks (:meth:`Timer.fire_if_due`) and waits for. The consumer keeps three: scheduled jobs due
(promotion), wake-ups a channel held back, and the retry of updates that met a row lock.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import Any

__all__ = ["Timer"]


class Timer:
    """Calls ``callback`` once at :attr:`at` (monotonic), the earliest time it was asked for."""

    def __init__(self, callback: Callable[[], object]):
        self._callback = callback
        self.at: float | None = None  #: when it fires; None: not armed
        self._loop: Any = None
        self._entry: Any = None

    def at_latest(self, at: float) -> None:
        """Fire at ``at``, unless it fires earlier already."""
        if self.at is not None and self.at <= at:
            return
        self.at = at
        self._schedule()

    def attach(self, loop: Any) -> None:
        """From now on an entry in ``loop``'s timers (armed already: now too)."""
        self._loop = loop
        self._schedule()

    def detach(self) -> None:
        """The loop is gone: disarmed."""
        self._cancel()
        self._loop, self.at = None, None

    def fire(self) -> None:
        """Now, disarmed first (the callback may arm it again)."""
        self._cancel()
        self.at = None
        self._callback()

    def fire_if_due(self, now: float) -> bool:
        """The synchronous path's check: fired if it was due at ``now``."""
        if self.at is None or now < self.at:
            return False
        self.fire()
        return True

    def _schedule(self) -> None:
        if self._loop is None or self.at is None:
            return
        self._cancel()
        self._entry = self._loop.call_later(max(self.at - monotonic(), 0.0), self.fire)

    def _cancel(self) -> None:
        if self._entry is not None:
            self._entry.cancel()
            self._entry = None
