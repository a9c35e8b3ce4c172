"""The claim's cursor (issue 26): where ``ClaimPolicy`` starts a queue's next claim, and the
places the wake-ups name (``jobs_wake_payload``, 0014_claim_cursor.sql). No database: the
claims' rows are made here; tests/integration/test_claim_cursor.py runs them for real."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from pgbroker._consume import claim_policy as claims
from pgbroker._model.claimed import Claimed, HEAD, JobRow, parse_wake
from pgbroker._consume.claim_policy import ClaimPolicy

T0 = datetime(2026, 12, 2, 7, 0, tzinfo=timezone.utc)


def row(seconds: float, priority: int = 0) -> JobRow:
    return JobRow(id=uuid.uuid4(), queue="q", attempt=1, priority=priority,
                  run_at=T0 + timedelta(seconds=seconds), exchange="", routing_key="q",
                  body=b"{}", content_type=None, content_encoding=None, headers={},
                  properties={})


def place(rows: Claimed) -> tuple[int, datetime, uuid.UUID]:
    last = rows[-1]
    return (-last.priority, last.run_at, last.id)


def test_a_claim_moves_the_cursor_past_its_last_row_and_one_that_took_none_leaves_it() -> None:
    policy = ClaimPolicy(10)
    assert policy.start("q") == HEAD
    full = Claimed.of([row(2), row(1)])
    policy.took("q", full, want=2)
    assert policy.start("q") == place(full)  # (run_at 2: the later one)
    short = Claimed.of([row(3)])
    policy.took("q", short, want=2)
    assert policy.start("q") == place(short)
    policy.took("q", Claimed.of([]), want=2)
    assert policy.start("q") == place(short)


def test_a_wake_up_moves_the_cursor_back_to_its_place_and_never_forward() -> None:
    policy = ClaimPolicy(10)
    policy.start("q")
    policy.took("q", Claimed.of([row(60)]), want=5)
    policy.start("q")
    policy.took("q", Claimed.of([]), want=5)
    late = (0, T0, uuid.UUID(int=0))
    policy.lower("q", late)
    assert policy.start("q") == late
    policy.took("q", Claimed.of([]), want=5)
    policy.lower("q", (0, T0 + timedelta(seconds=5), uuid.UUID(int=0)))
    policy.lower("q", late)
    assert policy.start("q") == late  # the earliest of the two
    policy.lower("q", HEAD)
    assert policy.start("q") == HEAD


def test_a_place_named_while_the_claim_was_in_flight_is_kept_over_its_result() -> None:
    """The row it names may have committed after the claim's snapshot: the claim did not see
    it, and its rows (later ones) must not move the cursor past it."""
    policy = ClaimPolicy(10)
    assert policy.start("q") == HEAD  # sent
    late = (0, T0, uuid.UUID(int=0))
    policy.lower("q", late)           # a NOTIFY read before the result
    policy.took("q", Claimed.of([row(10), row(11)]), want=2)
    assert policy.start("q") == late
    last = Claimed.of([row(12)])
    policy.took("q", last, want=5)
    assert policy.start("q") == place(last)  # that claim found it: nothing named since


def test_rescan_and_a_gated_queue_start_from_the_head() -> None:
    policy = ClaimPolicy(10)
    policy.start("q")
    policy.took("q", Claimed.of([row(1)]), want=1)
    policy.rescan()
    assert policy.start("q") == HEAD
    gated = Claimed.of([row(1)], gated=True)
    policy.took("q", gated, want=1)
    assert policy.start("q") == HEAD


def test_a_claim_that_did_not_run_starts_the_next_from_the_head() -> None:
    policy = ClaimPolicy(10)
    policy.start("q")
    policy.took("q", Claimed.of([row(1)]), want=1)
    policy.start("q")
    policy.took("q", [], want=1)  # given up on a superseded connection (_loop.result)
    assert policy.start("q") == HEAD


def test_the_wake_payload_names_a_place_just_before_its_rows() -> None:
    us = int((T0 - datetime(1970, 1, 1, tzinfo=timezone.utc)) / timedelta(microseconds=1))
    delay, at = parse_wake(f"0,5,{us}")  # type: ignore[misc]
    assert delay == 0 and at == (-5, T0, uuid.UUID(int=0))
    assert parse_wake("2.5") == (2.5, HEAD)  # an older pgbroker's, or a resume's: no place
    # spoofed ones are no wake-ups, or stay in the column's range (a smallint parameter)
    assert parse_wake("0,1") is None and parse_wake("x") is None
    assert parse_wake("0,1,99999999999999999999999") is None
    assert parse_wake(f"0,99999,{us}") == (0.0, (-255, T0, uuid.UUID(int=0)))


def test_the_poll_claims_from_the_head_every_few_polls_while_notifies_arrive() -> None:
    policy = ClaimPolicy(10)
    policy.start("q")
    last = Claimed.of([row(1)])
    policy.took("q", last, want=1)
    for _ in range(claims.RESCAN_POLLS - 1):
        policy.polled(notified=True)
        assert policy.more and policy.start("q") == place(last)  # NOTIFYs name places
        policy.took("q", Claimed.of([]), want=1)
    policy.polled(notified=True)
    assert policy.start("q") == HEAD  # now and then from the head: a NOTIFY may be lost
    policy.took("q", last, want=1)
    policy.polled(notified=False)
    assert policy.start("q") == HEAD  # poll-only (transaction pooling): at every poll
