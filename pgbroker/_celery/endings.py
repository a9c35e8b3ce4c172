"""How a delivery ended, where only its worker can tell: a revoke Celery carried out, a retry
its task sent.

Connected to Celery's signals by ``import pgbroker``, as :mod:`pgbroker._celery.failures` is; each
writes one fact into the delivery's row (matched by job id *and* attempt; ``sql/endings.sql``,
columns of migration 0018):

* ``task_revoked``, in the worker's main process: Celery discarded the delivery before its task
  started (it was revoked, or had expired), or terminated the pool process running it
  (``revoke(id, terminate=True)`` on prefork). Only then does a revoked job end ``cancelled``.
  A revoke that arrived while the task ran and that the pool could not carry out sends no such
  signal -- ``-P threads``, solo and gevent cannot terminate a task, and a revoke without
  ``terminate`` never stops one that runs -- so the job ends as its task ended it,
  ``completed`` (or ``dead``), its ``revoked_at`` and last error saying that a revoke came.
  Celery acks the delivery just before it sends the signal, and that ack may be written first:
  the statement then turns the ``completed`` it wrote into ``cancelled``.
* ``task_retry``, in the process that ran the task, before Celery acks it: the task sent a
  Celery retry (``self.retry()``, ``autoretry_for``), whose next try is a new job of the same
  task id with ``retries + 1``. Its row still ends ``completed``; it is counted (``pgbroker
  stats``, ``/metrics``, the admin page) and shown (``pgbroker jobs show``, the job page) as
  retried, with the retry's reason as its last error.

Limits: a write is retried on a new connection for up to ``RECORD_FOR`` seconds
(:mod:`pgbroker._celery.hook_store`) while the database cannot be reached, then given up, logged at
ERROR: the job then ends as its ack alone says (``completed``, with the revoke's note but not
cancelled; or not counted as retried).
Workers of a pgbroker older than migration 0018 end every revoked job ``cancelled``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from .._model.message import parse_delivery_tag
from .hook_store import retrying, store_for

__all__ = ["connect", "on_task_retry", "on_task_revoked"]

logger = logging.getLogger(__name__)


def on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False,
                    signum: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery's ``task_revoked``: it discarded or terminated this delivery."""
    if terminated:
        note = f"its worker terminated it (signal {signum}) before it finished"
    elif expired:
        note = "expired before it started: its worker discarded it"
    else:
        note = "its worker discarded it before it started"
    _record(sender, request, "stopped", note)


def on_task_retry(sender: Any = None, request: Any = None, reason: Any = None,
                  **_: Any) -> None:
    """Celery's ``task_retry``: the task sent a retry of itself (a new job)."""
    _record(sender, request, "retried", f"retried: {reason}"[:10000])


def _record(task: Any, request: Any, how: str, note: str) -> None:
    # (the delivery tag pgbroker made, "<job id>/<attempt>", is in the request's properties)
    properties = getattr(request, "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    delivery = parse_delivery_tag(tag) if isinstance(tag, str) and "/" in tag else None
    if delivery is None:
        return  # not delivered by pgbroker
    try:
        store = store_for(task.app, "pgbroker endings hook")
        if store is not None:
            retrying(store, lambda: store.record_ending(how, delivery[0], delivery[1], note))
    except Exception as exc:  # noqa: BLE001 - never turn a revoke or a retry into a crash
        logger.error("pgbroker: could not record that delivery %s was %s (%s): %s", tag, how,
                     note, exc)


def connect() -> None:
    """Connect the handlers to Celery's signals (done by ``import pgbroker``)."""
    signals.task_revoked.connect(on_task_revoked, weak=False, dispatch_uid="pgbroker.revoked")
    signals.task_retry.connect(on_task_retry, weak=False, dispatch_uid="pgbroker.retried")
