"""The shop's Django tasks (``django.tasks``), run by pgbroker's backend."""

from __future__ import annotations

import os
import time

from django.db import connection
from django_tasks import task

from .models import Order


@task()
def confirm(order_id: int) -> int:
    """Confirm an order: it must exist, so the job must not run before its transaction
    commits."""
    if Order.objects.filter(pk=order_id).update(confirmed=True) != 1:
        raise LookupError(f"order {order_id} does not exist")
    return order_id


@task(priority=50, queue_name="urgent")
def urgent(word: str) -> str:
    return word.upper()


@task()
def noop(n: int) -> int:
    """The benchmark's task (tests/bench/django_tasks_bench.py): nothing but its own cost."""
    return n


@task()
def record(n: int, pause: float = 0.0) -> int:
    """The soak's task (tests/chaos/test_django_tasks_kills.py): a row per run, in
    ``public.soak_runs``, so duplicates are counted with SQL."""
    time.sleep(pause)  # the task's body: a task that takes this long
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO public.soak_runs (n, pid) VALUES (%s, %s)", (n, os.getpid()))
    return n
