"""One rule for a naive time (issue 28): UTC, in a message's eta or expires and in a result's
date_done alike, whatever the process's local time zone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest

from pgbroker import backend
from pgbroker._model.message import aware, message_to_job
from pgbroker.settings import Settings

NAIVE = datetime(2026, 12, 2, 12, 0)
UTC = NAIVE.replace(tzinfo=timezone.utc)


@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's local time five hours behind UTC."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_naive_time_is_utc_in_a_message_and_in_a_result(new_york: None) -> None:
    assert aware(NAIVE) == UTC
    message = {"body": b"{}", "content-type": "application/json", "content-encoding": "utf-8",
               "headers": {"id": "t-1", "task": "t.a", "eta": NAIVE.isoformat()},
               "properties": {"delivery_tag": None}}
    assert message_to_job(Settings(), "q", message).run_at == UTC
    assert backend._timestamp(NAIVE.isoformat()) == UTC
    assert backend._timestamp(NAIVE) == UTC
