"""What a claim does when its statement fails: one machine for both paths that claim,
``Store.claim`` (``drain_events``) and the event loop's ``LoopStatements``.

A claim carries its channel's deferred acks, folded into the same statement. When it fails:

* a deadlock, or a row moved to the other partition of ``jobs`` under it
  (:data:`pgbroker._pg.driver.RERUN_ERRORS`): rolled back whole, acks included; sent again as it
  was, up to :data:`pgbroker._pg.driver.RERUN_TRIES` times in all;
* an ack's row that another session holds locked (``lock_timeout``: the claim's candidates are
  ``SKIP LOCKED``, its acks are not): the acks go to ``job_ack`` later, which skips locked rows,
  and the claim is sent again without them; a lock met with no acks is a table's (``LOCK
  TABLE``, ``CREATE INDEX``): sent again, waiting a ``lock_timeout`` slice at a time;
* any other error on a living connection (a full disk, a statement timeout, a trigger) with
  acks: their updates may be what failed, so they too go to ``job_ack`` (tried again until made,
  :mod:`pgbroker._consume.settle`) and the claim is sent again without them;
* anything else (a lost connection, a failure of a claim without acks): raised.

``job_ack`` sent alone by the event loop follows the same machine (``claim=False``): its acks
are never dropped for a lock, which ``job_ack`` skips, only for a failure.
"""

from __future__ import annotations

import enum

import psycopg

from . import driver

__all__ = ["ClaimRetry", "Step"]


class Step(enum.Enum):
    AGAIN = "send it again as it was"
    WITHOUT_ACKS = "its acks to job_ack later; the claim again without them"
    RAISE = "raise"


class ClaimRetry:
    """One claim's (or one ack's) way through its failures: see the module docstring."""

    def __init__(self) -> None:
        self.reruns = 0

    def step(self, error: BaseException, acks: bool, claim: bool = True) -> Step:
        """What to do after ``error``; ``acks``: the statement still carries acks."""
        if isinstance(error, driver.RERUN_ERRORS) and self.reruns < driver.RERUN_TRIES - 1:
            self.reruns += 1
            return Step.AGAIN
        if isinstance(error, psycopg.errors.LockNotAvailable):
            return Step.WITHOUT_ACKS if acks and claim else Step.AGAIN
        if acks and not driver.lost_connection(error):
            return Step.WITHOUT_ACKS
        return Step.RAISE

    def done(self) -> None:
        """The statement ran: the next one starts with a full budget of reruns."""
        self.reruns = 0
