"""ticketflow's periodic tasks, run by ``celery beat`` with pgbroker's database scheduler.

``expire_reservations`` runs every minute (on the whole minute: pgbroker's beat puts interval
schedules on a grid counted from the epoch); ``TICKETFLOW_EXPIRE_INTERVAL`` (seconds) shortens the
interval for the demo's short mode and the tests. Each run is also given ``expires`` equal to the
interval: a run nobody picked up before the next one is due is dropped (never delivered), so a
stopped worker does not come back to a pile of identical expiry jobs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_EXPIRE_INTERVAL", "DEFAULT_EXPIRE_INTERVAL", "expire_interval", "beat_schedule"]

ENV_EXPIRE_INTERVAL = "TICKETFLOW_EXPIRE_INTERVAL"
DEFAULT_EXPIRE_INTERVAL = 60.0


def expire_interval(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between two runs of ``expire_reservations``: ``TICKETFLOW_EXPIRE_INTERVAL`` or 60.

    Raises:
        ValueError: the variable is set but is not a number of seconds from 0.5 to 86400.
    """
    raw = environ.get(ENV_EXPIRE_INTERVAL, "").strip()
    if not raw:
        return DEFAULT_EXPIRE_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.5 <= value <= 86400:  # also refuses nan
        raise ValueError(f"{ENV_EXPIRE_INTERVAL}={raw!r}: expected a number of seconds from "
                         "0.5 to 86400")
    return value


def beat_schedule(interval: float | None = None) -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` setting (``interval`` defaults to :func:`expire_interval`)."""
    every = expire_interval() if interval is None else interval
    return {
        "expire-reservations": {
            "task": "ticketflow.tasks.expire_reservations",
            "schedule": every,
            # pgbroker's beat policies: after downtime, one run for all the missed time; never
            # two runs at once (a slow run makes the next occurrence skip, not pile up).
            "options": {"expires": every, "misfire": "latest", "overlap": "skip"},
        },
    }
