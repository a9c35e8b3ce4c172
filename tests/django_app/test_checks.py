"""pgbroker's system checks (``manage.py check``) on the settings a project gets wrong, each
read by Django's own check runner in this process (``override_settings``); the schema checks
are ``test_app.py``'s, through ``manage.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kombu.transport import TRANSPORT_ALIASES

ELSEWHERE = "pgbroker+postgresql://postgres@127.0.0.1:5432/another_database"


@pytest.fixture
def checks(django_db: Any, broker_url: str) -> Iterator[Any]:
    """Run pgbroker's checks under settings (the broker on this test's database unless said)."""
    # Django is configured by django_db
    from django.core.checks import run_checks
    from django.test import override_settings

    def run(**settings: Any) -> list[str]:
        with override_settings(**{"CELERY_BROKER_URL": broker_url, **settings}):
            return [f"{m.id}: {m.msg} ({m.hint})" for m in run_checks(tags=["pgbroker"])]

    yield run


def _ids(messages: list[str]) -> list[str]:
    return [m.partition(":")[0] for m in messages]


def test_a_project_configured_right_has_no_issue(checks: Any) -> None:
    assert checks() == []
    assert checks(PGBROKER_JOIN_ATOMIC=True) == []


def test_broker_on_another_database(checks: Any) -> None:
    [joined] = checks(CELERY_BROKER_URL=ELSEWHERE, PGBROKER_JOIN_ATOMIC=True)
    assert joined.startswith("pgbroker.E002") and "PGBROKER_JOIN_ATOMIC" in joined
    assert _ids(checks(CELERY_BROKER_URL=ELSEWHERE)) == ["pgbroker.W002"]
    # the database Django's connection names is the broker's: no issue
    assert checks(CELERY_BROKER_URL="pgbroker+django://default",
                  PGBROKER_JOIN_ATOMIC=True) == []


def test_acks_early_with_job_keys(checks: Any) -> None:
    beat = {"sync": {"task": "shop.sync", "schedule": 60.0,
                     "options": {"headers": {"concurrency_key": "sync"}}},
            "plain": {"task": "shop.plain", "schedule": 60.0}}
    [early] = checks(CELERY_BEAT_SCHEDULE=beat, CELERY_TASK_ACKS_LATE=False)
    assert early.startswith("pgbroker.E003") and "'sync'" in early and "acks_late" in early
    assert checks(CELERY_BEAT_SCHEDULE=beat, CELERY_TASK_ACKS_LATE=True) == []


@pytest.mark.parametrize("url, says", [
    ("postgresql://postgres@127.0.0.1/db", "plain PostgreSQL URL"),
    ("sqla+postgresql://postgres@127.0.0.1/db", "another transport"),
    ("pgbrokr://postgres@127.0.0.1/db", "no transport kombu knows"),
])
def test_a_broker_url_that_is_not_pgbrokers(checks: Any, url: str, says: str) -> None:
    [wrong] = checks(CELERY_BROKER_URL=url)
    assert wrong.startswith("pgbroker.E004") and says in wrong
    assert "pgbroker+postgresql://" in wrong


def test_the_scheme_registered_to_another_transport(checks: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRANSPORT_ALIASES, "pgbroker", "kombu.transport.memory:Transport")
    [wrong] = checks()
    assert wrong.startswith("pgbroker.E004") and "not pgbroker's transport" in wrong
