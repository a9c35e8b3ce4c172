from celery import shared_task

from .models import Order


@shared_task
def confirm_order(order_id: int) -> int:
    """Confirm an order: it must exist, so the job must not run before its transaction commits."""
    updated = Order.objects.filter(pk=order_id).update(confirmed=True)
    if updated != 1:
        raise LookupError(f"order {order_id} does not exist")
    return order_id
