"""Celery's revoke, made durable: a revoked job never runs, whoever starts or restarts when.

Celery keeps revoked task ids in each worker's memory only (celery#818, #4300): a task revoked
while it waited for its eta ran anyway once the worker restarted, and a revoke sent while no
worker ran reached nobody. With the queue in PostgreSQL the revoke can be written down:

* ``app.control.revoke(id)``, ``AsyncResult.revoke()``, ``celery control revoke|terminate ID``
  publish a broadcast to the ``<namespace>.pidbox`` fanout exchange. The transport recognises it
  at publish (:func:`request_of`, called from ``Channel._put_fanout`` in the producer's process)
  and runs ``job_revoke`` (``sql/revoke.sql``) instead of the plain broadcast insert: one
  statement cancels the ids' pending and scheduled jobs, flags the claimed ones (running, or
  prefetched in a worker's memory) with ``revoked_at``, writes an audit row per job, and inserts
  the broadcast the live workers read. This works with no worker running at all.
* A flagged job never goes back to ``pending``: requeued, restored at shutdown or rescued by the
  sweeper after its worker died, it ends ``cancelled``. Acked, it ends ``cancelled`` when its
  worker carried the revoke out -- discarded the delivery, or terminated the pool process running
  it (:mod:`pgbroker._celery.endings`) -- and otherwise as its task ended it (``completed`` or
  ``dead``): a thread pool cannot terminate a task, and a revoke without ``terminate`` stops none
  that runs. Its ``revoked_at`` and last error say that a revoke came.
* ``pgbroker revoke ID...`` (the CLI) runs the same statement with a broadcast it builds itself
  (:func:`pidbox_message`) and prints what happened to each id (:class:`Outcome`).

Limits: ``revoke_by_stamped_headers`` stays Celery's in-memory revoke (stamps are not indexed).
A retry that a running task publishes after it was revoked is a new job, not cancelled (live
workers still discard it: they hold the id in memory). A revoke names task ids: an id with no
job yet (revoked before it is sent) changes nothing in the database.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kombu.serialization import dumps, loads

from .._pg.store import NewJob, Store
from ..ops import os_user

__all__ = ["Outcome", "RevokeRequest", "apply", "pidbox_message", "request_of"]

logger = logging.getLogger(__name__)

#: Celery's pidbox methods that revoke by task id (``terminate`` is revoke with terminate=True).
_METHODS = ("revoke", "terminate")

#: Ids named in one log line at most (a group's revoke can name thousands).
_LOGGED_IDS = 10

_FINISHED = ("completed", "dead", "cancelled", "expired")

#: What the revoking process logs for the ids of each kind of outcome that changed nothing.
_UNCHANGED = {
    "not found": "no job has this task id, nothing changed",
    "already finished": "already finished, nothing changed",
    "already revoked": "already revoked while running, nothing changed",
    "busy": "being changed by another transaction, nothing changed: revoke again",
}


@dataclass(frozen=True)
class RevokeRequest:
    """What a revoke broadcast asks for."""

    task_ids: tuple[str, ...]
    terminate: bool = False
    signal: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What a revoke did to one task id: to one of its jobs (``changed``), or why nothing."""

    task_id: str
    job_id: uuid.UUID | None
    #: the job's state before the revoke when changed; else its newest job's state as the
    #: revoke found it (``revoked``: running, flagged by an earlier revoke), None: no job
    state: str | None
    changed: bool

    @property
    def kind(self) -> str:
        if self.changed:
            return "flagged" if self.state == "running" else "cancelled"
        if self.state is None:
            return "not found"
        if self.state == "revoked":
            return "already revoked"
        return "already finished" if self.state in _FINISHED else "busy"

    def __str__(self) -> str:
        job = f"job {self.job_id}"
        return {
            "cancelled": f"{job} cancelled (was {self.state})",
            "flagged": f"{job} flagged while running: it never runs again "
                       "(cancelled if its worker stops it, else as its task ends)",
            "not found": "not found: no job has this task id, nothing changed",
            "already revoked": f"{job} already revoked while running, nothing changed",
            "already finished": f"{job} already finished ({self.state}), nothing changed",
            "busy": f"{job} was being changed by another transaction, nothing changed: "
                    f"revoke again",
        }[self.kind]


def request_of(exchange: str, message: dict[str, Any]) -> RevokeRequest | None:
    """The revoke a message published to a fanout ``exchange`` asks for, else None.

    ``message`` is the kombu message as ``basic_publish`` prepared it (its own process made it,
    so decoding it trusts nothing from outside)."""
    if not exchange.endswith(".pidbox"):
        return None
    try:
        body = loads(message.get("body"), message.get("content-type"),
                     message.get("content-encoding"), accept=None)
    except Exception:  # noqa: BLE001 - not ours to judge: it is published as it is
        return None
    if not isinstance(body, dict) or body.get("method") not in _METHODS:
        return None
    arguments = body.get("arguments") or {}
    ids = arguments.get("task_id")  # one id or a list, as Celery's maybe_list takes it
    if not isinstance(ids, (list, tuple, set)):
        ids = [ids]
    task_ids = tuple(dict.fromkeys(str(i) for i in ids if i is not None))
    if not task_ids:
        return None
    terminate = body["method"] == "terminate" or bool(arguments.get("terminate"))
    return RevokeRequest(task_ids, terminate, arguments.get("signal"))


def apply(store: Store, request: RevokeRequest, broadcast: NewJob | None = None, *, via: str,
          actor: str | None = None, log: bool = True) -> list[Outcome]:
    """Revoke ``request``'s ids in the database (and insert ``broadcast`` for the live workers,
    in the same statement); log what changed, and what did not (unless ``log`` is False: the
    CLI prints it); return an :class:`Outcome` per job changed or id unchanged."""
    actor = actor or os_user()
    detail = {"via": via, "terminate": request.terminate, "signal": request.signal,
              "host": socket.gethostname(), "pid": os.getpid()}
    rows = store.revoke(request.task_ids, actor=actor, reason=f"revoked by {actor} ({via})",
                        detail=detail, broadcast=broadcast)
    outcomes = [Outcome(str(r[0]), r[1], r[2], bool(r[3])) for r in rows]
    if log:
        _log(outcomes)
    return outcomes


def _log(outcomes: Sequence[Outcome]) -> None:
    """One line per kind of outcome: INFO for changes, WARNING for ids that changed nothing
    (a typo, or a task that already ran: whoever revoked should know the revoke did nothing)."""
    by_kind: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome.kind, []).append(outcome)
    for kind, items in by_kind.items():
        shown = ", ".join(o.task_id if kind != "already finished" else f"{o.task_id} ({o.state})"
                          for o in items[:_LOGGED_IDS])
        if len(items) > _LOGGED_IDS:
            shown += f" and {len(items) - _LOGGED_IDS} more"
        if kind == "cancelled":
            logger.info("pgbroker: revoke cancelled %d job(s) of task id(s) %s", len(items),
                        shown)
        elif kind == "flagged":
            logger.info("pgbroker: revoke flagged %d running job(s) of task id(s) %s: they "
                        "never run again", len(items), shown)
        else:
            logger.warning("pgbroker: revoke of task id(s) %s: %s", shown, _UNCHANGED[kind])


def pidbox_message(request: RevokeRequest, namespace: str = "celery",
                   timeout: float = 60.0) -> dict[str, Any]:
    """The broadcast ``app.control.revoke`` would publish to ``<namespace>.pidbox`` (kombu's
    ``Mailbox._publish``: no reply asked, ``expires`` after ``timeout`` seconds), as
    ``basic_publish`` prepares it: for the CLI, which has no Celery app."""
    method = "terminate" if request.terminate else "revoke"
    arguments: dict[str, Any] = {"task_id": list(request.task_ids)}
    if request.terminate:
        arguments["signal"] = request.signal or "SIGTERM"
    content_type, encoding, body = dumps(
        {"method": method, "arguments": arguments, "destination": None, "pattern": None,
         "matcher": None}, serializer="json")
    return {
        "body": body, "content-type": content_type, "content-encoding": encoding,
        "headers": {"clock": 0, "expires": time.time() + timeout},
        "properties": {"delivery_mode": 1, "priority": 0,
                       "delivery_info": {"exchange": f"{namespace}.pidbox",
                                         "routing_key": ""}},
    }
