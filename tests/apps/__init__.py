"""The applications the tests run, shared by the tiers: Celery apps that ``celery worker`` and
``celery beat`` processes import by name (``-A tests.apps.e2e_app``), and the Django test project
(``tests/apps/django_project``). A task's name is its module's dotted name, so moving an app
renames its tasks: the names in the tests move with it.

An app used by one tier alone may stay in that tier (``tests/e2e/jobsem_app.py``,
``tests/bench/benchapp.py``); an app that several tiers import lives here.
"""
