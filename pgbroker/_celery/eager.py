"""Celery's eager mode for :func:`pgbroker.enqueue`, ``enqueue_many`` and their asyncio forms:
run, do not write.

Under ``task_always_eager`` Celery runs ``.delay()`` and ``.apply_async()`` in the caller, at
once, and writes nothing (``Task.apply``). :func:`pgbroker.enqueue` does the same for a task
object or a task name the app knows; a name it does not know is written as usual, as Celery's
``send_task`` does. The message is still built and checked first when the app's broker is
pgbroker's, so a bad option or a missing required idempotency key fails as it would in
production. Exceptions propagate when ``task_eager_propagates`` is on (Celery's rule).

What eager mode cannot give (Celery's own limits, and pgbroker's guarantees that live in the
database): no transaction (the task runs even if the caller then rolls back), no idempotency
key, dedupe or concurrency key, no ``countdown``/``eta``/``expires``, no queue, no priority.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from celery.utils import uuid as task_uuid

from .._produce.build import app_of, unpack
from .app import find

__all__ = ["checked", "eager_task", "prepare", "run", "run_many", "split"]


def eager_task(app: Any, task: Any) -> Any | None:
    """The task object to run for ``task`` now, or None (not eager, or a name the app lacks)."""
    app = app_of(app, task)
    if not app.conf.task_always_eager:
        return None
    if isinstance(task, str):
        return app.tasks.get(task)
    return task


def run(task: Any, args: Sequence[Any], kwargs: dict[str, Any] | None,
        headers: dict[str, Any] | None) -> uuid.UUID:
    """Run ``task`` as ``apply_async`` runs it under ``task_always_eager``; its task id."""
    result = task.apply(tuple(args), kwargs or {}, task_id=task_uuid(), headers=headers)
    return uuid.UUID(result.id)


def checked(app: Any, task: Any, check: Callable[[], object]) -> None:
    """``check()`` (build the message, no I/O) when the app's broker is pgbroker's."""
    if find(app_of(app, task)) is not None:
        check()


Eager = dict[int, tuple[Any, Sequence[Any], Any, Any]]


def split(jobs: list[Sequence[Any]], app: Any) -> tuple[Eager, list[Sequence[Any]]]:
    """``enqueue_many``'s items: the ones to run eagerly (by index: task, args, kwargs,
    headers), and the others, to write."""
    eager: Eager = {}
    on: dict[int, bool] = {}  # per app: a batch of thousands asks its app's setting once
    for index, item in enumerate(jobs):
        task, args, kwargs, options = unpack(index, item)
        item_app = app_of(app, task)
        flag = on.get(id(item_app))
        if flag is None:
            flag = on[id(item_app)] = bool(item_app.conf.task_always_eager)
        if flag:
            found = eager_task(item_app, task)
            if found is not None:
                eager[index] = (found, args, kwargs, options.get("headers"))
    if not eager:
        return eager, jobs
    return eager, [item for index, item in enumerate(jobs) if index not in eager]


def prepare(jobs: Iterable[Sequence[Any]], app: Any,
            check: Callable[[list[Sequence[Any]]], object],
            ) -> tuple[int, Eager, list[Sequence[Any]]]:
    """``enqueue_many``'s first step: how many items, the eager ones (checked with ``check``,
    which builds their messages, when the broker is pgbroker's), and the ones to write."""
    everything = list(jobs)
    eager, rest = split(everything, app)
    if eager:
        checked(app, eager[min(eager)][0], lambda: check([everything[i] for i in eager]))
    return len(everything), eager, rest


def run_many(count: int, eager: Eager, written: list[uuid.UUID]) -> list[uuid.UUID]:
    """Run the eager items (after the others were written); every id in input order."""
    rest = iter(written)
    return [run(*eager[i]) if i in eager else next(rest) for i in range(count)]
