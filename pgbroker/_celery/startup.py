"""What a Celery worker says once: diagnostics of its database, of its tasks' job keys, and
that it was told to stop.

Connected to Celery's ``worker_ready`` by ``import pgbroker``, so that a worker says it once per
start -- not every consumer: ``celery inspect`` and ``celery status`` consume (their reply
queue) too, and a warning on their stderr at every call is noise. Plain kombu consumers outside
a Celery worker are not told. And to ``task_received``: a job whose keys count it while it runs
(``concurrency_key``, ``dedupe_active``) for a task acked on receipt, once per task name. And a
worker told to stop says so in its consumers' rows (``stopping_at``), so that its jobs rescued
after a kill count against no task (pgbroker._model.stopping): it hears SIGTERM, SIGINT and SIGQUIT
ahead of Celery's own handlers (wrapped once the worker is ready: a soft shutdown waits out
``worker_soft_shutdown_timeout`` inside Celery's handler, and sends ``worker_shutting_down``
only then), and ``worker_shutting_down`` besides.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Any

from celery import current_app, signals

from .._model import stopping as _stopping
from .._pg.store import Store
from ..transport import Transport
from .app import find

__all__ = ["connect", "on_task_received", "on_worker_shutting_down", "warn_without_autovacuum"]

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()


def warn_without_autovacuum(store: Store) -> None:
    """Once per process and schema: say so when nothing will vacuum ``jobs``."""
    key = (store.conninfo, store.settings.schema)
    if key in _warned:
        return
    _warned.add(key)
    try:
        on = store.autovacuum_on()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the worker
        logger.debug("pgbroker: cannot tell whether autovacuum runs: %s", exc)
        return
    if not on:
        table = f"{store.settings.schema}.jobs"
        logger.warning(
            "pgbroker: autovacuum is off for %s. Every task leaves dead row versions behind that "
            "only VACUUM removes, and claims slow down as they pile up. The workers' sweepers "
            "vacuum the hot tables themselves meanwhile (if this role owns them); turn autovacuum "
            "on, or run 'VACUUM %s' every minute or so (docs/operations.md, \"Vacuum\").",
            table, table)


#: The task names warned of by :func:`on_task_received`.
_early: set[str] = set()


def on_task_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Celery's ``task_received``, in the worker: a concurrency key or ``dedupe_active`` counts
    a job while it is 'running', which ends at its ack -- at receipt, unless the task acks
    late. Its copies would then run at once, and nothing else would show it."""
    task = getattr(request, "task", None)
    if task is None or task.acks_late or task.name in _early:
        return
    headers = getattr(getattr(request, "message", None), "headers", None) or {}
    keys = [k for k in ("concurrency_key", "dedupe_active") if headers.get(k)]
    if keys:
        _early.add(task.name)
        logger.warning(
            "pgbroker: task %s is acked on receipt, and its jobs carry %s: a job counts as "
            "running only until its ack, so its copies are not held back while it runs. Set "
            "task_acks_late = True (or acks_late=True on the task).", task.name, " and ".join(keys))


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Celery's ``worker_ready``: the worker's diagnostics, on a connection of their own; and
    its ears for the signals that stop it (:func:`told_to_stop`)."""
    transport = getattr(getattr(sender, "connection", None), "transport", None)
    if not isinstance(transport, Transport):
        return
    settings = dataclasses.replace(transport.settings, auto_migrate=False)
    store = Store(transport.conninfo, settings, application_name="pgbroker diagnostics")
    try:
        warn_without_autovacuum(store)
    finally:
        store.close()
    _hear_stop_signals()


def _hear_stop_signals() -> None:
    """Wrap Celery's handlers of the signals that stop a worker, so that this process knows it
    was told to stop before Celery's handler runs (and maybe waits). Once per process."""
    for name in ("SIGTERM", "SIGINT", "SIGQUIT"):
        number = getattr(signal, name, None)
        if number is None:
            continue
        handler = signal.getsignal(number)
        if not callable(handler) or getattr(handler, "pgbroker_hears", False):
            continue

        def heard(signum: int, frame: Any, _handler: Any = handler, _name: str = name) -> Any:
            told_to_stop(_name)
            return _handler(signum, frame)

        heard.pgbroker_hears = True  # type: ignore[attr-defined]
        try:
            signal.signal(number, heard)
        except ValueError:  # not the main thread: worker_shutting_down still tells
            return


def on_worker_shutting_down(sender: Any = None, how: str = "Warm", **_: Any) -> None:
    """Celery's ``worker_shutting_down``, in the worker's main process: see
    :func:`told_to_stop`."""
    told_to_stop(f"{how} shutdown")


def told_to_stop(how: str) -> None:
    """This worker process was told to stop (in a signal handler): its later pool-process
    losses count for nothing from now, and a thread writes ``stopping_at`` into its consumers'
    rows, so that a sweeper rescuing its jobs after a kill (a grace period that ran out)
    counts them against no task. Once per process."""
    if _stopping.told():
        return
    _stopping.mark()
    broker = find(current_app)  # no I/O: the worker's app, its broker options
    if broker is not None:
        threading.Thread(target=_mark_stopping, args=(broker, how), daemon=True,
                         name="pgbroker-stopping").start()


def _mark_stopping(broker: Any, how: str) -> None:
    store = Store(broker.conninfo, dataclasses.replace(broker.settings, auto_migrate=False),
                  application_name="pgbroker stopping")
    try:
        n = store.mark_stopping()
        logger.info("pgbroker: told to stop (%s): %d consumer(s) marked stopping; their jobs "
                    "lost from now on count against no task", how, n)
    except Exception as exc:  # noqa: BLE001 - the shutdown goes on; a later loss may count
        logger.warning("pgbroker: could not mark this worker stopping: %s; a kill before its "
                       "tasks end may count against them", exc)
    finally:
        store.close()


def connect() -> None:
    """Connect the handlers to Celery's signals (done by ``import pgbroker``)."""
    signals.worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="pgbroker.startup")
    signals.task_received.connect(on_task_received, weak=False, dispatch_uid="pgbroker.early")
    signals.worker_shutting_down.connect(on_worker_shutting_down, weak=False,
                                         dispatch_uid="pgbroker.stopping")
