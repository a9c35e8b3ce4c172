"""pgbroker.complete() on each kind of connection a task may hold (issue 22, point 7): Django's
inside ``transaction.atomic()``, SQLAlchemy's session, psycopg's -- a rollback leaves the delivery
running, a commit completes it with the task's rows; and the refusals. (Real workers killed
around the commit: tests/e2e/test_exactly_once.py.)"""

from __future__ import annotations

import types
import uuid
from typing import Any

import psycopg
import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import pgbroker
from tests.integration.test_django import Abort, client  # noqa: F401 - fixtures
from tests.support.db import add_job, job_fields


def _running(pg: psycopg.Connection, attempts: int = 1) -> tuple[uuid.UUID, Any]:
    """A running job, and a stand-in for the task running its delivery (what complete() reads
    of a task: its app and ``request.properties``, as Celery hands them over)."""
    job = add_job(pg, "running", attempts=attempts)
    return job, types.SimpleNamespace(request=types.SimpleNamespace(
        properties={"delivery_tag": f"{job}/{attempts}"}), app=None)


def test_django_atomic(client: Celery, django_db: Any, pg: psycopg.Connection) -> None:  # noqa: F811
    from django.db import connection, transaction

    from tests.apps.django_project.shop.models import Order

    job, task = _running(pg)
    task.app = client
    with pytest.raises(Abort), transaction.atomic():
        Order.objects.create(item="rolled back")
        pgbroker.complete(connection, task)
        raise Abort
    assert job_fields(pg, "state", "completed_attempt", id=job) == ("running", None)
    with transaction.atomic():
        Order.objects.create(item="kept")
        pgbroker.complete(connection, task)
    assert job_fields(pg, "state", "completed_attempt", id=job) == ("completed", 1)
    assert [o.item for o in Order.objects.all()] == ["kept"]


def test_sqlalchemy_and_psycopg(client: Celery, db_url: str, pg: psycopg.Connection) -> None:  # noqa: F811
    pg.execute("CREATE TABLE public.effects (job uuid)")
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    job, task = _running(pg)
    task.app = client
    with Session(engine) as session:
        session.execute(text("INSERT INTO public.effects VALUES (:j)"), {"j": job})
        pgbroker.complete(session, task)
        session.rollback()
    assert job_fields(pg, "state", "completed_attempt", id=job) == ("running", None)
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO public.effects VALUES (:j)"), {"j": job})
        pgbroker.complete(session, task)
    engine.dispose()
    assert job_fields(pg, "state", "completed_attempt", id=job) == ("completed", 1)

    # a second completion of the same delivery, and one of a delivery taken back, are refused
    # (the task's transaction must then not commit)
    with psycopg.connect(db_url) as conn:
        with pytest.raises(pgbroker.DeliveryLost, match="completed already"):
            pgbroker.complete(conn, task)
    moved, stale = _running(pg, attempts=2)
    stale.app = client
    stale.request.properties["delivery_tag"] = f"{moved}/1"
    with psycopg.connect(db_url) as conn:
        with pytest.raises(pgbroker.DeliveryLost, match="taken back"):
            pgbroker.complete(conn, stale)
        conn.rollback()
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(TypeError, match="autocommit"):
            pgbroker.complete(conn, task)
    assert pg.execute("SELECT count(*) FROM public.effects").fetchone() == (1,)
