"""Cluster-wide rate limits: the ``rate_limits`` transport option, parsed (a consumer's lease
writes it where every consumer's claim reads it: :mod:`pgbroker._consume.lease`).

``broker_transport_options={"rate_limits": {"app.call_api": "10/s"}}`` takes Celery's rate
syntax (``"10/s"``, ``"100/m"``, ``"1000/h"``; a bare number is per second). Celery's own
``rate_limit`` is per worker; this one bounds the claims of a task by every consumer together:
at most N in any period (a sliding window), the jobs beyond it deferred in the database
(``job_claim_gated``, ``sql/migrations/0010_job_keys.sql``). A consumer writes its configuration to
``rate_limits`` when it registers; one started without the option leaves the table as it is, one
with ``{}`` removes every limit.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError

__all__ = ["RateLimit", "parse_rate", "parse_rate_limits"]

_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:/\s*([smh]))?\s*")

#: Longest task name in bytes (pgbroker._model.message.MAX_ID_BYTES).
_MAX_TASK_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class RateLimit:
    """At most ``max_starts`` claims of ``task`` in any ``period`` seconds."""

    task: str
    max_starts: int
    period: float
    rate: str  # as configured


def parse_rate(task: str, rate: Any) -> RateLimit:
    """``"10/s"`` (Celery's syntax) for ``task``; a :class:`ConfigurationError` for anything
    else. A fractional count keeps its rate: ``"0.5/s"`` is one claim per 2 seconds."""
    if isinstance(rate, bool) or not isinstance(rate, (str, int, float)):
        raise ConfigurationError(f"rate_limits[{task!r}] must be a rate such as '10/s', "
                                 f"'100/m' or '1000/h', not {rate!r}")
    text = str(rate)
    match = _RATE_RE.fullmatch(text)
    if match is None:
        sign = " (a rate limit cannot be negative)" if text.strip().startswith("-") else ""
        raise ConfigurationError(
            f"rate_limits[{task!r}] = {rate!r} is not Celery's rate syntax{sign}: use N/s, N/m "
            "or N/h (N > 0; a bare number is per second)")
    count, period = float(match[1]), _PERIODS[match[2] or "s"]
    if count <= 0:
        raise ConfigurationError(f"rate_limits[{task!r}] = {rate!r} allows nothing: a rate must "
                                 "be above 0 (pause the queue or the task to stop it)")
    if count.is_integer():
        if count > 2**31 - 1:
            raise ConfigurationError(f"rate_limits[{task!r}] = {rate!r} is too large")
        return RateLimit(task, int(count), period, text)
    return RateLimit(task, 1, period / count, text)


def parse_rate_limits(value: Any) -> tuple[RateLimit, ...]:
    """The ``rate_limits`` option (``{task name: rate}``), checked."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"rate_limits must be a mapping of task names to rates such "
                                 f"as {{'app.call_api': '10/s'}}, not {value!r}")
    limits = []
    for task, rate in value.items():
        if not isinstance(task, str) or not task or len(task.encode()) > _MAX_TASK_BYTES:
            raise ConfigurationError(f"rate_limits: {task!r} is not a task name (a non-empty "
                                     f"string of at most {_MAX_TASK_BYTES} bytes)")
        limits.append(parse_rate(task, rate))
    return tuple(sorted(limits, key=lambda limit: limit.task))
