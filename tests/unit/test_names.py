"""Unit tests of pgbroker._model.message' pure helpers: queue name validation, delivery tags, and
the
parsing of Celery's ``eta``/``expires`` headers."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from pgbroker.errors import MessageError
from pgbroker._model.message import (
    MAX_NAME_LENGTH,
    delivery_tag as _delivery_tag,
    _timestamp,
    parse_delivery_tag,
    validate_queue_name,
)

# -- queue names ----------------------------------------------------------------------------------

VALID_NAMES = [
    "celery",
    "it's a \"quoted\" queue",
    "q'); DROP TABLE pgbroker.jobs; --",
    "%(queue)s {schema} $1 \\N",
    "очередь-é-队列-🚀",
    " leading and trailing spaces ",
    "tab\tand\nnewline",
    "a" * 255,
    "a" * MAX_NAME_LENGTH,
    "x",
]


@pytest.mark.parametrize("name", VALID_NAMES, ids=range(len(VALID_NAMES)))
def test_valid_names_are_returned_unchanged(name: str) -> None:
    assert validate_queue_name(name) is name


def test_the_limit_is_at_least_255() -> None:
    assert MAX_NAME_LENGTH >= 255


@pytest.mark.parametrize(("name", "match"), [
    ("", "non-empty string"),
    (None, "non-empty string"),
    (5, "non-empty string"),
    (b"bytes", "non-empty string"),
    ("nul\x00byte", "NUL byte"),
    ("a" * (MAX_NAME_LENGTH + 1), f"{MAX_NAME_LENGTH + 1} characters long; the limit is"),
])
def test_invalid_names_are_refused(name: object, match: str) -> None:
    with pytest.raises(MessageError, match=match):
        validate_queue_name(name)


def test_the_error_names_what_was_refused() -> None:
    with pytest.raises(MessageError, match="^exchange name"):
        validate_queue_name("", what="exchange")


def test_message_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        validate_queue_name("")


# -- delivery tags --------------------------------------------------------------------------------

@pytest.mark.parametrize("attempt", [1, 2, 17, 2**31 - 1])
@pytest.mark.parametrize("transient", [False, True])
def test_delivery_tag_round_trip(attempt: int, transient: bool) -> None:
    job_id = uuid.uuid4()
    tag = _delivery_tag(job_id, attempt, transient)
    assert tag.startswith(f"{job_id}/{attempt}")
    assert parse_delivery_tag(tag) == (job_id, attempt, transient)


def test_two_deliveries_of_one_job_have_different_tags() -> None:
    job_id = uuid.uuid4()
    assert _delivery_tag(job_id, 1) != _delivery_tag(job_id, 2)


def test_a_broadcast_delivery_has_no_row_to_acknowledge() -> None:
    assert parse_delivery_tag(f"b/{uuid.uuid4()}/3") is None


#: A fixed id, so that the parameters (and the test ids) are the same in every process (xdist).
A_UUID = uuid.UUID("0190a6e2-57c1-7b3e-9a55-3f2d1c0b9e41")


@pytest.mark.parametrize("tag", [
    "", "garbage", "/1", f"{A_UUID}/", f"{A_UUID}/x", "not-a-uuid/1",
    f"{A_UUID}/1/x", f"{A_UUID}/1/t/t",
    pytest.param(str(A_UUID), id="kombu-tag"),
])
def test_malformed_delivery_tags_are_refused(tag: str) -> None:
    # Tags made by something else are not ours: acking one must fail loudly, not guess.
    with pytest.raises(ValueError):
        parse_delivery_tag(tag)


# -- eta / expires headers ------------------------------------------------------------------------

AWARE = datetime(2026, 3, 1, 12, 30, 15, 250000, tzinfo=timezone.utc)
PARIS = timezone(timedelta(hours=1))


@pytest.mark.parametrize("value", [None, 0])
def test_timestamp_none_or_zero_is_none(value: object) -> None:
    assert _timestamp(value, "eta") is None


@pytest.mark.parametrize("value", [AWARE.timestamp(), int(AWARE.timestamp())])
def test_timestamp_reads_numbers_as_epoch_seconds(value: float) -> None:
    # kombu's pidbox sends expires as epoch seconds
    expected = AWARE if isinstance(value, float) else AWARE.replace(microsecond=0)
    assert _timestamp(value, "expires") == expected


@pytest.mark.parametrize("value", [1e20, float("nan"), float("inf")])
def test_timestamp_refuses_numbers_out_of_range(value: float) -> None:
    with pytest.raises(MessageError, match="is not a valid time"):
        _timestamp(value, "expires")


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-03-01T12:30:15.250000+00:00", AWARE),
    ("2026-03-01T13:30:15.250000+01:00", AWARE),
    ("2026-03-01T12:30:15.250000Z", AWARE),
    ("2026-03-01T12:30:15.250000", AWARE),  # naive: Celery's UTC
    ("2026-03-01 12:30:15.25", AWARE),
])
def test_timestamp_parses_iso_8601_text(text: str, expected: datetime) -> None:
    value = _timestamp(text, "eta")
    assert value == expected
    assert value is not None and value.tzinfo is not None


def test_timestamp_keeps_the_zone_of_an_aware_datetime() -> None:
    value = datetime(2026, 3, 1, 13, 30, tzinfo=PARIS)
    assert _timestamp(value, "expires") is value


def test_timestamp_reads_a_naive_datetime_as_utc() -> None:
    assert _timestamp(datetime(2026, 3, 1, 12, 30, 15, 250000), "eta") == AWARE


@pytest.mark.parametrize("value", ["tomorrow", "2026-13-01T00:00:00", "", "12:30"])
def test_timestamp_refuses_text_that_is_not_iso_8601(value: str) -> None:
    with pytest.raises(MessageError, match=f"the eta header {value!r} is not an ISO 8601 time"):
        _timestamp(value, "eta")


@pytest.mark.parametrize("value", [True, ["2026-03-01"], {"at": 1}, b"2026-03-01"])
def test_timestamp_refuses_other_types(value: object) -> None:
    with pytest.raises(MessageError, match="the expires header must be an ISO 8601 time"):
        _timestamp(value, "expires")
