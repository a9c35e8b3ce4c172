"""A minimal Django project (settings, Celery app, one app ``shop``) for the Django tests.

The worker runs ``celery -A tests.apps.django_project.celery worker`` with
``DJANGO_SETTINGS_MODULE=tests.apps.django_project.settings``; its database is the test's
(``PGBROKER_DATABASE_URL``, set by ``tests.support.processes.run_worker``).
"""
