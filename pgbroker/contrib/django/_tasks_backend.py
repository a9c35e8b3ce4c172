"""The ``django.tasks`` backend on pgbroker (see :mod:`pgbroker.contrib.django.tasks`).

* ``enqueue``: one Celery message for ``pgbroker.django_task`` written on Django's connection
  (``OPTIONS["DATABASE"]``, default ``"default"``) through :func:`pgbroker.contrib.django.
  transaction`: inside the caller's ``atomic()`` it exists exactly when that commits; outside,
  at once. ``run_after`` is a durable eta (the job waits in the table), ``priority``
  (-100..100) maps to pgbroker's 0..200 (higher first, both), ``queue_name`` is the queue --
  but Django's ``"default"`` is Celery's default queue (``celery``), so a plain
  ``celery worker`` runs them; another queue needs ``celery worker -Q celery,<name>``.
* ``get_result``: the task's newest job and its result row, read on Django's connection:
  status (READY for pending/scheduled, RUNNING, SUCCESSFUL, FAILED for dead/cancelled/expired),
  enqueued/started/finished times, the last error and traceback, the consumer as worker id, the
  return value (with a pgbroker result backend: ``CELERY_RESULT_BACKEND``).

Limits: no ``takes_context`` tasks and no coroutine tasks yet (refused at definition); the
errors list holds the last attempt's error only; ``last_attempted_at`` is the last claim.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.db import connections
from django.utils import timezone
from django.utils.module_loading import import_string
from kombu.serialization import loads, prepare_accept_content

from ..._pg.catalogue import Queries
from ..._pg.django_db import driver_connection
from . import conf, transaction
from .conf import TASK_NAME

try:  # optional: Django 6's task framework, else the django-tasks backport
    from django.tasks import (
        DEFAULT_TASK_QUEUE_NAME as DEFAULT_QUEUE, TaskResult, TaskResultStatus)
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import (
        InvalidTaskError, TaskResultDoesNotExist)
except ImportError:
    from django_tasks import DEFAULT_TASK_QUEUE_NAME as DEFAULT_QUEUE
    from django_tasks import TaskResult, TaskResultStatus
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import TaskError
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist

__all__ = ["Backend", "PRIORITY_OFFSET"]

#: pgbroker's priority = Django's (-100..100) + this: 0..200, higher first as in Django.
PRIORITY_OFFSET = 100

_STATUS = {"pending": "READY", "scheduled": "READY", "running": "RUNNING",
           "completed": "SUCCESSFUL", "dead": "FAILED", "cancelled": "FAILED",
           "expired": "FAILED"}


class Backend(BaseTaskBackend):
    """Django tasks as pgbroker jobs, run by the project's Celery workers."""

    supports_defer = True
    supports_async_task = False
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database = self.options.get("DATABASE", "default")
        self._app: Any = None

    @property
    def app(self) -> Any:
        if self._app is None:
            self._app = conf.celery_app()
        return self._app

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        if task.takes_context:
            raise InvalidTaskError("pgbroker's backend does not run takes_context tasks yet")

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        task_id = str(uuid.uuid4())
        with transaction(using=self.database):
            self.app.send_task(TASK_NAME, (task.module_path, list(args), dict(kwargs)),
                               task_id=task_id, eta=task.run_after,
                               queue=None if task.queue_name == DEFAULT_QUEUE else task.queue_name,
                               priority=task.priority + PRIORITY_OFFSET)
        return TaskResult(task=task, id=task_id, status=TaskResultStatus.READY,
                          enqueued_at=timezone.now(), started_at=None, last_attempted_at=None,
                          finished_at=None, args=list(args), kwargs=dict(kwargs),
                          backend=self.alias, errors=[], worker_ids=[])

    def get_result(self, result_id: str) -> Any:
        schema = conf.settings().schema
        row = next(iter(Queries(schema).dicts(driver_connection(connections[self.database]),
                                              "job_get_for_django_task", {"task_id": result_id})),
                   None)  # at most one (LIMIT 1)
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        module_path, args, kwargs = loads(
            bytes(row["body"]), row["content_type"], row["content_encoding"],
            accept=prepare_accept_content(self.app.conf.accept_content))[0]
        status = TaskResultStatus[_STATUS[row["state"]]]
        result = _json(row["result"])
        errors = []
        if status == TaskResultStatus.FAILED:
            exc = result if isinstance(result, dict) else {}
            path = ".".join(p for p in (exc.get("exc_module"), exc.get("exc_type")) if p)
            errors.append(TaskError(exception_class_path=path or "builtins.Exception",
                                    traceback=row["last_traceback"] or row["last_error"] or ""))
        task_result = TaskResult(
            task=import_string(module_path), id=result_id, status=status,
            enqueued_at=row["created_at"], started_at=row["locked_at"],
            last_attempted_at=row["locked_at"],
            finished_at=row["updated_at"] if status in (
                TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
            args=args, kwargs=kwargs, backend=self.alias, errors=errors,
            worker_ids=[str(row["locked_by"])] if row["locked_by"] else [])
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(task_result, "_return_value", result)
        return task_result


def _json(value: Any) -> Any:
    # jsonb arrives as text on Django's connection (Django parses its own)
    return json.loads(value) if isinstance(value, str) else value
