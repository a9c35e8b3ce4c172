"""The job keys a message may carry in its headers, checked at publish.

``dedupe_key`` (with ``dedupe_active``) keeps at most one copy of a task queued; ``concurrency_key``
(with ``concurrency_limit``) runs its copies N at a time across every worker. They are headers, so
``apply_async(headers=...)``, ``.delay()`` through a task's defaults and beat entries can set them
as well as :func:`pgbroker.enqueue`'s keywords; the insert statements copy them into the job's
columns (``sql/migrations/0010_job_keys.sql``). A bad value is a :class:`MessageError` here, so
nothing is written for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import MessageError
from .text import checked_name

__all__ = ["KEY_HEADERS", "MAX_KEY_BYTES", "MAX_CONCURRENCY_LIMIT", "check_headers", "dedupe_key"]

#: The headers this module owns (also the keywords of pgbroker.enqueue).
KEY_HEADERS = ("dedupe_key", "dedupe_active", "concurrency_key", "concurrency_limit")

#: Longest key in bytes of UTF-8: the name limit (pgbroker._model.message.MAX_ID_BYTES); a dedupe
# key
#: shares an index entry with the task name.
MAX_KEY_BYTES = 1024

#: Largest concurrency_limit (an integer column; a limit this high is no limit).
MAX_CONCURRENCY_LIMIT = 2**31 - 1


def _key(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise MessageError(f"{what} must be a non-empty string, not {value!r}")
    return checked_name(value, what, MAX_KEY_BYTES)


def check_headers(headers: Mapping[str, Any]) -> None:
    """Raise :class:`MessageError` unless the job keys in ``headers`` are valid (absent or None
    is no key)."""
    if headers.get("dedupe_key") is not None:
        _key(headers["dedupe_key"], "dedupe_key")
    active = headers.get("dedupe_active")
    if active is not None:
        if not isinstance(active, bool):
            raise MessageError(f"dedupe_active must be true or false, not {active!r}")
        if active and headers.get("dedupe_key") is None:
            raise MessageError("dedupe_active=True needs a dedupe_key")
    if headers.get("concurrency_key") is not None:
        _key(headers["concurrency_key"], "concurrency_key")
    limit = headers.get("concurrency_limit")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or not (
                1 <= limit <= MAX_CONCURRENCY_LIMIT):
            raise MessageError(f"concurrency_limit must be a positive integer (how many copies "
                               f"run at once), not {limit!r}")
        if headers.get("concurrency_key") is None:
            raise MessageError("concurrency_limit needs a concurrency_key")


def dedupe_key(headers: Mapping[str, Any]) -> str | None:
    """The dedupe key of a checked message's headers (None: none)."""
    value = headers.get("dedupe_key")
    return value if isinstance(value, str) else None
