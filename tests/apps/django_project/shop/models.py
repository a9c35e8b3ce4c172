from django.db import models


class Order(models.Model):
    """An order; ``confirm_order`` (a Celery task) sets ``confirmed``."""

    item = models.CharField(max_length=100)
    confirmed = models.BooleanField(default=False)
