"""What the consumer hands to kombu: a claimed row as a kombu payload, and each broadcast once.

:func:`row_payload` checks a claimed row and builds its payload (a row that cannot be one raises,
and :class:`pgbroker._consume.consumer.Consumer` buries it with the reason). :class:`Broadcasts`
reads a broadcast the first time its NOTIFY arrives here: any role that can connect can replay one.
"""

from __future__ import annotations

import uuid
from time import monotonic
from typing import Any

from .._model.claimed import JobRow
from .._model.message import TRANSIENT, delivery_tag, due_now, kombu_payload
from .._model.text import Unreadable
from .._pg.store import BROADCAST_TTL, Store

__all__ = ["row_payload", "broadcast_payload", "Broadcasts"]


def row_payload(row: JobRow) -> dict[str, Any]:
    """The kombu payload of a claimed row; ValueError or TypeError if it cannot be one."""
    for what, value in (("headers", row.headers), ("properties", row.properties)):
        if isinstance(value, Unreadable):  # see pgbroker._model.text.load_jsonb
            raise ValueError(f"its {what} cannot be read back: {value.reason}")
        if not isinstance(value, dict):
            raise TypeError("headers and properties must be JSON objects")
    tag = delivery_tag(row.id, row.attempt, row.properties.get("delivery_mode") == TRANSIENT)
    headers = due_now(row.headers)  # due by the database clock: by this one too
    return kombu_payload(row.body, row.content_type, row.content_encoding, headers,
                         row.properties, row.exchange, row.routing_key, row.priority,
                         tag, redelivered=row.attempt > 1)


def broadcast_payload(row: tuple[Any, ...], broadcast_id: str, n: int) -> dict[str, Any]:
    """The kombu payload of a broadcast's row (see :meth:`Broadcasts.read`), for its ``n``-th
    bound queue here (each delivery has a tag of its own)."""
    exchange, routing_key, body, content_type, content_encoding, headers, properties, _ = row
    return kombu_payload(body, content_type, content_encoding, headers, properties, exchange,
                         routing_key, 0, f"b/{broadcast_id}/{n}", redelivered=False)


class Broadcasts:
    """The broadcasts this process has delivered, so that each is delivered once."""

    def __init__(self, store: Store):
        self.store = store
        #: broadcast id -> when it was delivered here
        self._seen: dict[str, float] = {}

    def seen(self, broadcast_id: str) -> bool:
        return broadcast_id in self._seen

    def read(self, broadcast_id: str, exchange: str) -> tuple[Any, ...] | None:
        """The row of a broadcast to ``exchange`` not delivered here yet: (exchange, routing
        key, body, content type, content encoding, headers, properties, queues or None for
        all). None when seen already, pruned, or the NOTIFY named another exchange (spoofed)."""
        if broadcast_id in self._seen:
            return None
        try:
            row = self.store.broadcast_get(uuid.UUID(broadcast_id), BROADCAST_TTL)
        except ValueError:
            return None
        if row is None or row[0] != exchange:  # pruned already, or a spoofed exchange
            return None
        self._remember(broadcast_id)
        return row

    def _remember(self, broadcast_id: str) -> None:
        now = monotonic()
        seen = self._seen
        seen[broadcast_id] = now
        while seen:  # oldest first (insertion order): forget what can no longer be read
            oldest = next(iter(seen))
            if now - seen[oldest] < 2 * BROADCAST_TTL:
                break
            del seen[oldest]
