"""The admin page's parts that need no database: credentials and their strength, the login
throttle, loopback addresses, the charts' histograms and time windows (moved here from
tests/integration/test_admin*.py, unchanged).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from pgbroker.admin.auth import OPERATOR, Credentials, Login, LoginThrottle, is_loopback
from pgbroker.admin.stats import Histogram, window
from pgbroker.errors import ConfigurationError
from tests.support.admin import CREDS


def test_credentials_and_loopback() -> None:
    token = "t0ken-0123456789"
    assert Credentials.from_env({"PGBROKER_ADMIN_TOKEN": token}).configured
    assert not Credentials.from_env({}).configured
    with pytest.raises(ConfigurationError, match="set both"):
        Credentials.from_env({"PGBROKER_ADMIN_PASSWORD": "p"})
    assert CREDS.login("alice", "correct horse", None) == Login("alice", OPERATOR)
    assert CREDS.login(None, None, "s3cret-token-0123") == Login("alice", OPERATOR)
    assert Credentials(token=token).login(None, None, token) == Login("token", OPERATOR)
    assert CREDS.login("alice", "", None) is None and CREDS.login(None, None, "") is None
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "", "::", "10.0.0.1", "example.com"]))


def test_throttle_refills_with_time() -> None:
    now = [0.0]
    throttle = LoginThrottle(burst=3, interval=10.0, clock=lambda: now[0])
    for _ in range(3):
        assert throttle.wait("a") == 0
        throttle.failed("a")
    assert throttle.wait("a") == pytest.approx(10.0)
    assert throttle.wait("b") == 0
    now[0] = 5.0
    assert throttle.wait("a") == pytest.approx(5.0)
    now[0] = 10.0
    assert throttle.wait("a") == 0


def test_the_total_of_failures_is_throttled_too() -> None:
    throttle = LoginThrottle(burst=10, total_burst=5, total_interval=1.0, clock=lambda: 0.0)
    for i in range(5):
        throttle.failed(f"10.0.0.{i}")  # five addresses, one failure each
    assert throttle.wait("10.0.0.99") == pytest.approx(1.0)


@pytest.mark.parametrize("given", [
    {"token": "x"}, {"token": "aaaaaaaaaaaaaaaaaaaaaaaa"}, {"token": "short-token-12"},
    {"user": "alice", "password": "hunter2"}, {"user": "a", "password": "abababababababab"},
    {"token": "s3cret-token-0123", "viewer_token": "v"},
])
def test_weak_secrets_are_refused(given: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="too weak"):
        Credentials(**given)


def test_percentiles_from_buckets() -> None:
    h = Histogram({"16": 98, "24": 2})  # 98 runs of ~250 ms, 2 of ~3 s
    low, high = Histogram.bounds(16)
    assert low <= 250 < high
    assert low <= h.percentile(50) < high
    assert Histogram.bounds(24)[0] <= h.percentile(99) < Histogram.bounds(24)[1]
    assert Histogram().percentile(50) is None
    assert Histogram({"0": 1}).percentile(50) == pytest.approx(0.5)


def test_windows_and_their_steps() -> None:
    now = datetime.fromisoformat("2026-12-01T10:17:30+00:00")
    assert (window(now, "1h").step, window(now, "24h").step, window(now, "7d").step) == \
        (60, 1800, 7200)
    assert window(now, "nonsense").key == "1h"
    custom = window(now, None, now - timedelta(hours=2), now - timedelta(hours=1))
    assert (custom.key, custom.live, custom.step) == (None, False, 60)
    assert window(now, None, now - timedelta(days=30)).since == now - timedelta(days=7)
    with pytest.raises(ValueError, match="empty"):
        window(now, None, now, now - timedelta(minutes=1))
