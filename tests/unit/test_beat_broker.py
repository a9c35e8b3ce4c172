"""pgbroker's beat scheduler refuses an app that does not use pgbroker as its broker (the rest of
the scheduler, on a real database: tests/integration/test_beat.py)."""

from __future__ import annotations

import pytest
from celery import Celery

from pgbroker.beat import Scheduler
from pgbroker.errors import ConfigurationError


def test_a_broker_other_than_pgbroker_is_refused() -> None:
    app = Celery("other", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="uses the 'memory' broker"):
        Scheduler(app, lazy=True)
