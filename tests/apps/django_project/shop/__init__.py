"""The test project's one app: orders, confirmed by a Celery task."""
