"""The Django project of the example; its Celery app is loaded with it (Celery's Django guide),
so ``.delay()`` in views, the shell and tests uses it."""

from .celery import app as celery_app

__all__ = ["celery_app"]
