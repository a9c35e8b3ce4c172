"""pgbroker's signals: a job ended dead, a task name was paused or resumed.

They are Celery signals (``celery.utils.dispatch.Signal``), connected the same way::

    from pgbroker import signals

    @signals.job_dead.connect
    def alert(sender, job_id, task, reason, attempts, **kwargs):
        if task == "ticketflow.tasks.capture_payment":
            pager.page(f"payment job {job_id} is dead after {attempts} attempts: {reason}")

Each fires in the process whose statement made the change, right after it committed (the
worker's main process for an ack, requeue or rejection; its pool process for the failure of a
task acked on receipt; the sweeper -- inside every worker, or ``pgbroker sweep`` -- for a job
whose consumer was lost; the CLI or admin process for an operator's pause). It fires once per
change: the change is a conditional UPDATE that only one statement can make. At most once: a
process killed between the commit and the signal sends nothing (the row still says ``dead``,
and ``pgbroker dead list`` shows it). A receiver that raises is logged and does not stop the
others (Celery's ``Signal.send``); it runs on the worker's event loop or lease thread, so it
must be quick -- hand slow work (an e-mail) to a task.

``job_dead(sender=task name, job_id, task, reason, attempts)``
    A job ended ``dead``: out of attempts, rejected, or its task failed. (Not an unroutable
    publish, kept ``dead`` in ``pgbroker.unroutable`` from the start: it never ran, and it may
    be written in a producer's transaction that has not committed yet.)

``task_paused(sender=task name, task, reason, job_ids, actor)``
    A task name was paused: no worker claims it until it is resumed. ``actor`` is
    ``"pgbroker"`` when it paused itself (``pause_task_after`` deliveries in a row killed their
    pool process, or took down that many different workers none of which was told to stop;
    ``reason`` names the evidence, ``job_ids`` the jobs), else the operator. A pause by
    pgbroker is also logged at CRITICAL in the process that made it (a worker's main process,
    or the sweeper's).

``task_resumed(sender=task name, task, reason, actor)``
    A paused task name was resumed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from celery.utils.dispatch import Signal

__all__ = ["job_dead", "task_paused", "task_resumed", "send_job_dead", "send_task_paused",
           "send_task_resumed", "SELF"]

logger = logging.getLogger(__name__)

#: The actor of a pause that pgbroker made itself.
SELF = "pgbroker"

job_dead = Signal(name="job_dead", providing_args={"job_id", "task", "reason", "attempts"})
task_paused = Signal(name="task_paused",
                     providing_args={"task", "reason", "job_ids", "actor"})
task_resumed = Signal(name="task_resumed", providing_args={"task", "reason", "actor"})


def send_job_dead(rows: Iterable[tuple[uuid.UUID, str | None, str | None, int]]) -> None:
    """``job_dead`` for each ``(job id, task, reason, attempts)``; never raises."""
    for job_id, task, reason, attempts in rows:
        logger.warning("pgbroker: job %s (task %s) is dead after %d attempt(s): %s", job_id,
                       task, attempts, reason)
        _send(job_dead, task, job_id=job_id, task=task, reason=reason, attempts=attempts)


def send_task_paused(task: str, reason: str, job_ids: Sequence[uuid.UUID],
                     actor: str) -> None:
    """``task_paused`` (and its log line); never raises."""
    if actor == SELF:
        logger.critical("pgbroker: task %r is PAUSED: %s; no worker claims it until it is "
                        "resumed (pgbroker task resume %s). Jobs that caused it: %s", task,
                        reason, task, ", ".join(map(str, job_ids)) or "none")
    else:
        logger.info("pgbroker: %s paused task %r: %s", actor, task, reason)
    _send(task_paused, task, task=task, reason=reason, job_ids=list(job_ids), actor=actor)


def send_task_resumed(task: str, reason: str, actor: str) -> None:
    """``task_resumed`` (and its log line); never raises."""
    logger.info("pgbroker: %s resumed task %r: %s", actor, task, reason)
    _send(task_resumed, task, task=task, reason=reason, actor=actor)


def _send(signal: Signal, sender: Any, **named: Any) -> None:
    try:
        signal.send(sender=sender, **named)
    except Exception:  # a signal never turns an ack or a sweep into a failure
        logger.exception("pgbroker: sending %s failed", signal.name)
