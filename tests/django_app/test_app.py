"""pgbroker's Django app in a project (``tests/apps/django_project``), through ``manage.py`` as a
user runs it: ``migrate`` makes the schema (``--fake`` does not, and ``check`` says so),
``manage.py pgbroker ...`` reads the project's broker, unapplying leaves the queue alone."""

from __future__ import annotations

import json

import psycopg
from celery import Celery

from pgbroker.migrate import latest_version
from tests.django_app.django_support import manage


def _versions(url: str) -> int | None:
    with psycopg.connect(url, autocommit=True) as conn:
        if not conn.execute("SELECT to_regclass('pgbroker.migrations')").fetchone()[0]:
            return None
        return conn.execute("SELECT max(version) FROM pgbroker.migrations").fetchone()[0]


def test_migrate_makes_the_schema_and_zero_leaves_it(empty_url: str) -> None:
    before = manage(empty_url, "check")
    assert before.returncode == 0 and "pgbroker.W001" in before.stderr, before.stderr
    done = manage(empty_url, "migrate")
    assert done.returncode == 0, done.stderr
    assert "Applying pgbroker.0001_schema... OK" in done.stdout
    assert _versions(empty_url) == latest_version()
    after = manage(empty_url, "check")
    assert after.returncode == 0 and "pgbroker." not in after.stderr, after.stderr
    # unapplying does nothing to the queue (its docstring says why)
    assert manage(empty_url, "migrate", "pgbroker", "zero").returncode == 0
    assert _versions(empty_url) == latest_version()


def test_a_faked_migration_is_named_by_check_and_mended(empty_url: str) -> None:
    assert manage(empty_url, "migrate", "pgbroker", "--fake").returncode == 0
    assert _versions(empty_url) is None
    check = manage(empty_url, "check")
    assert check.returncode == 1 and "pgbroker.E001" in check.stderr, check.stderr
    assert "manage.py pgbroker migrate" in check.stderr
    mend = manage(empty_url, "pgbroker", "migrate")
    assert mend.returncode == 0, mend.stderr
    assert _versions(empty_url) == latest_version()
    assert manage(empty_url, "check").returncode == 0


def test_manage_pgbroker_runs_the_cli_on_the_projects_broker(broker_url: str,
                                                              db_url: str) -> None:
    app = Celery("producer", broker=broker_url, set_as_current=False)
    try:
        app.send_task("shop.report", queue="reports")
    finally:
        app.close()
    stats = manage(db_url, "pgbroker", "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert "from the Celery app pgbroker.contrib.django.celery_app" in stats.stderr
    [queue] = [q for q in json.loads(stats.stdout)["queues"] if q["queue"] == "reports"]
    assert queue["pending"] == 1
    jobs = manage(db_url, "pgbroker", "jobs", "list", "--json")
    assert [j["task"] for j in json.loads(jobs.stdout)] == ["shop.report"]
    health = manage(db_url, "pgbroker", "health", "queue", "reports")
    assert health.returncode == 4, health.stdout  # missing: no consumer
    # without a pgbroker broker: DATABASES["default"]
    plain = manage(db_url, "pgbroker", "stats", env={"PGBROKER_TEST_NO_BROKER": "1"})
    assert plain.returncode == 0 and "reports" in plain.stdout, plain.stderr
