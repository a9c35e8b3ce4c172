"""The shop's Django tasks (``django.tasks``), run by pgbroker's backend."""

from __future__ import annotations

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
