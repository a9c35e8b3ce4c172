"""Whether this worker process was told to stop: what its later losses are evidence of.

A worker told to stop (SIGTERM, SIGINT or SIGQUIT: a warm, soft or cold shutdown; Celery's
``worker_shutting_down``, connected by :mod:`pgbroker._celery.startup`) and killed before its tasks
ended -- a rolling deploy whose grace period ran out -- lost them to its deployment, not to the
tasks. From then on neither a pool process of it that dies (:meth:`pgbroker._pg.store.Store.
record_losses`) nor its consumers' jobs rescued by a sweeper (``consumers.stopping_at``,
written by ``_startup``) count towards pausing a task (0019_loss_evidence.sql).
"""

from __future__ import annotations

import threading

__all__ = ["mark", "told"]

_told = threading.Event()


def mark() -> None:
    """This process was told to stop."""
    _told.set()


def told() -> bool:
    """Whether this process was told to stop."""
    return _told.is_set()
