"""``manage.py test`` of the test project: Django's runner makes its test database with
``migrate`` (so pgbroker's schema comes from pgbroker's Django migration) and runs Django's own
``TestCase`` and ``TransactionTestCase`` against ``.delay()`` joining ``atomic()``
(``tests/apps/django_project/shop/tests.py``), with a real worker for the committed case, and the
``django.tasks`` backend (``shop/backend_tests.py``), the operator page behind Django's login
(``shop/operator_tests.py``); and the same project in Celery's eager mode
(``shop/eager_tests.py``)."""

from __future__ import annotations

from tests.django_app.django_support import manage


def test_djangos_testcase_and_transactiontestcase(empty_url: str) -> None:
    done = manage(empty_url, "test", "tests.apps.django_project.shop",
                  "tests.apps.django_project.shop.backend_tests",
                  "tests.apps.django_project.shop.operator_tests", "--noinput", "-v", "2",
                  settings="tests.apps.django_project.settings_atomic")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Applying pgbroker.0001_schema... OK" in output
    assert "Ran 11 tests" in output and "OK" in output


def test_djangos_testcase_in_eager_mode(empty_url: str) -> None:
    done = manage(empty_url, "test", "tests.apps.django_project.shop.eager_tests", "--noinput",
                  settings="tests.apps.django_project.settings_eager")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Ran 2 tests" in output and "OK" in output
