"""pgbroker.backoff's table of waits between Celery retries (seed 000's), with its jitter."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pgbroker.backoff import SEED_TABLE, table_delay


def test_backoff_table() -> None:
    assert [table_delay(n, jitter=0) for n in range(7)] == [10, 40, 180, 720, 3000, 3000, 3000]
    rng = random.Random(7)
    delays = [table_delay(2, SEED_TABLE, 0.2, rng) for _ in range(200)]
    assert all(144 <= d <= 216 for d in delays) and len(set(delays)) > 100
    for bad in ({"table": ()}, {"table": (-1,)}, {"jitter": 1.5}, {"retries": -1}):
        kwargs: dict[str, Any] = {"retries": 0, **bad}
        with pytest.raises(ValueError):
            table_delay(**kwargs)
