"""Django's task framework (``django.tasks``, DEP 14) on pgbroker: the backend and the Celery
task that runs its tasks.

::

    TASKS = {"default": {"BACKEND": "pgbroker.contrib.django.tasks.Backend",
                         "QUEUES": ["default"], "OPTIONS": {"DATABASE": "default"}}}

A task's ``enqueue()`` writes one Celery message for :func:`run_django_task` on Django's
connection, in the caller's ``atomic()`` if one is open; the project's ``celery worker``
runs it (Celery's autodiscovery finds this module, ``<app>.tasks``, in every Django worker), so
Django tasks share the queue, stats, dead letters and revoke of the Celery tasks. Limit: they
all carry one Celery task name, :data:`TASK_NAME`, so ``stats --by-task``, task pauses and
rate limits see them as one task.
:class:`Backend` is in :mod:`pgbroker.contrib.django._tasks_backend`, imported on first use:
it needs Django 6's ``django.tasks`` or the ``django-tasks`` backport, this module does not.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils.module_loading import import_string

from .conf import TASK_NAME

__all__ = ["TASK_NAME", "Backend", "run_django_task"]  # noqa: F822 - Backend: __getattr__ below


# acks late, and back to the queue when the worker is lost: at least once, as a Django task
# backend with crash recovery promises (a task may run again if its worker died under it)
@shared_task(name=TASK_NAME, acks_late=True, reject_on_worker_lost=True)
def run_django_task(module_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Run the Django task at ``module_path`` (its module-level function) with its arguments;
    its return value (JSON-normalised) is the result ``get_result`` reads."""
    task = import_string(module_path)
    return task.call(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Backend":
        # optional: django.tasks (Django 6) or the django-tasks backport
        from ._tasks_backend import Backend

        return Backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
