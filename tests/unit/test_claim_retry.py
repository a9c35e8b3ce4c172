"""The one machine both claim paths follow when a claim's statement fails (issue 28): what it
does with each kind of failure, with and without acks folded in."""

from __future__ import annotations

import psycopg
import pytest

from pgbroker._pg.claim_retry import ClaimRetry, Step
from pgbroker._pg.driver import RERUN_TRIES

DISK_FULL = psycopg.errors.DiskFull("could not extend file")
LOCKED = psycopg.errors.LockNotAvailable("canceling statement due to lock timeout")
GONE = psycopg.OperationalError("server closed the connection unexpectedly")  # no SQLSTATE


@pytest.mark.parametrize("error", [psycopg.errors.DeadlockDetected("deadlock detected"),
                                   psycopg.errors.SerializationFailure("moved")])
def test_a_rolled_back_claim_is_sent_again_as_it_was_then_given_up(error: Exception) -> None:
    retry = ClaimRetry()
    assert [retry.step(error, acks=True) for _ in range(RERUN_TRIES - 1)] == \
        [Step.AGAIN] * (RERUN_TRIES - 1)
    # the budget spent: its acks go to job_ack, a claim without them is raised at the next
    assert retry.step(error, acks=True) is Step.WITHOUT_ACKS
    assert retry.step(error, acks=False) is Step.RAISE
    retry.done()
    assert retry.step(error, acks=False) is Step.AGAIN


def test_a_lock_drops_a_claims_acks_but_not_an_acks() -> None:
    retry = ClaimRetry()
    assert retry.step(LOCKED, acks=True) is Step.WITHOUT_ACKS
    assert retry.step(LOCKED, acks=False) is Step.AGAIN  # a table's lock: wait a slice again
    assert retry.step(LOCKED, acks=True, claim=False) is Step.AGAIN  # job_ack skips locked rows


def test_a_failure_on_a_living_connection_drops_the_acks_and_a_lost_one_is_raised() -> None:
    retry = ClaimRetry()
    assert retry.step(DISK_FULL, acks=True) is Step.WITHOUT_ACKS
    assert retry.step(DISK_FULL, acks=True, claim=False) is Step.WITHOUT_ACKS
    assert retry.step(DISK_FULL, acks=False) is Step.RAISE
    assert retry.step(GONE, acks=True) is Step.RAISE
