"""The ``rate_limits`` transport option: Celery's rate syntax, and clear errors for the rest."""

from __future__ import annotations

import pytest

from pgbroker._model.rate_limits import RateLimit, parse_rate
from pgbroker.errors import ConfigurationError
from pgbroker.settings import Settings


@pytest.mark.parametrize("rate, max_starts, period", [
    ("10/s", 10, 1.0), ("100/m", 100, 60.0), ("1000/h", 1000, 3600.0), ("7", 7, 1.0),
    (3, 3, 1.0), (" 2 / m ", 2, 60.0), ("0.5/s", 1, 2.0), ("1.5/m", 1, 40.0),
])
def test_celerys_rate_syntax(rate: object, max_starts: int, period: float) -> None:
    limit = parse_rate("t", rate)
    assert (limit.max_starts, limit.period) == (max_starts, period)


@pytest.mark.parametrize("rate, error", [
    ("10/d", "not Celery's rate syntax: use N/s, N/m or N/h"),
    ("10/sec", "not Celery's rate syntax"),
    ("-1/s", "cannot be negative"),
    (-5, "cannot be negative"),
    ("0/s", "allows nothing"),
    ("", "not Celery's rate syntax"),
    (None, "must be a rate such as '10/s'"),
    (True, "must be a rate such as '10/s'"),
])
def test_anything_else_is_a_clear_error(rate: object, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        Settings.from_options({"rate_limits": {"app.call_api": rate}})


def test_the_option() -> None:
    assert Settings().rate_limits is None  # not configured: the database's stay as they are
    assert Settings.from_options({"rate_limits": {}}).rate_limits == ()
    assert Settings.from_options({"rate_limits": {"b": "1/m", "a": "10/s"}}).rate_limits == (
        RateLimit("a", 10, 1.0, "10/s"), RateLimit("b", 1, 60.0, "1/m"))
    with pytest.raises(ConfigurationError, match="must be a mapping"):
        Settings.from_options({"rate_limits": ["a"]})
    with pytest.raises(ConfigurationError, match="is not a task name"):
        Settings.from_options({"rate_limits": {"": "1/s"}})
