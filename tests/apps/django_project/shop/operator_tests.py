"""pgbroker's operator page inside the project (``/ops/pgbroker/``), behind Django's login:
anonymous users go to the login page, non-staff get 403, staff see it read-only, staff with
``pgbroker.operate`` act, audited under their Django username. Run by
tests/django_app/test_django_runner.py (``manage.py test``)."""

from __future__ import annotations

import re

from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import TransactionTestCase

PAGE = "/ops/pgbroker/"


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, "the page's CSRF token"
    return found.group(1)


class OperatorPageTests(TransactionTestCase):
    def setUp(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO pgbroker.queues (name) VALUES ('reports')")

    def test_who_sees_and_who_acts(self) -> None:
        self.assertRedirects(self.client.get(PAGE), f"/accounts/login/?next={PAGE}",
                             fetch_redirect_response=False)
        self.client.force_login(User.objects.create_user("guest"))
        self.assertEqual(self.client.get(PAGE).status_code, 403)

        self.client.force_login(User.objects.create_user("watcher", is_staff=True))
        page = self.client.get(PAGE + "queues/reports")
        self.assertEqual(page.status_code, 200)
        self.assertIn("reports", page.content.decode())
        self.assertIn(f'href="{PAGE}', page.content.decode())  # its links stay under the mount
        refused = self.client.post(PAGE + "queues/pause",
                                   {"queue": "reports", "csrf_token": _csrf(page.content.decode())})
        self.assertEqual(refused.status_code, 403)  # read-only

        operator = User.objects.create_user("ops", is_staff=True)
        operator.user_permissions.add(Permission.objects.get(codename="operate"))
        self.client.force_login(operator)
        page = self.client.get(PAGE + "queues/reports")
        done = self.client.post(PAGE + "queues/pause",
                                {"queue": "reports", "csrf_token": _csrf(page.content.decode())})
        self.assertIn(done.status_code, (302, 303))
        self.assertTrue(done["Location"].startswith(PAGE), done["Location"])
        with connection.cursor() as cursor:
            cursor.execute("SELECT paused FROM pgbroker.queues WHERE name = 'reports'")
            self.assertEqual(cursor.fetchone(), (True,))
            cursor.execute("SELECT actor, action FROM pgbroker.audit")
            self.assertEqual(cursor.fetchall(), [("ops", "queue.pause")])
        forged = self.client.post(PAGE + "queues/resume", {"queue": "reports"})
        self.assertEqual(forged.status_code, 400)  # no CSRF token
