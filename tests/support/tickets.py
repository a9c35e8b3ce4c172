"""Look-ups shared by the ticketflow tests (tests/integration/test_ticketflow_services.py
and tests/e2e/test_ticketflow.py).

``ticketflow.app`` is pointed at the test's database for the duration of a test and made Celery's
current app (other test modules create apps of their own, and a ``@shared_task`` resolves through
the current app).
"""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy.orm import Session

from tests.support.db import rows
from tests.support.processes import WorkerProcess, run_worker
from ticketflow import services, tasks

__all__ = ["FAST_PDF", "start_worker", "held", "confirmed", "jobs_of", "rows", "seats_taken"]


#: Fast PDF renders, unless a test wants a slow one; short waits between a charge's retries.
FAST_PDF = {tasks.ENV_PDF_SECONDS: "0.05", tasks.ENV_CHARGE_BACKOFF: "0.5,1,2,4"}


def start_worker(broker_url: str, env: dict[str, str] | None = None) -> WorkerProcess:
    """One ``celery -A ticketflow worker`` for every pool's queues, ready."""
    return run_worker("ticketflow", broker_url, "-Q", "default,email,system,heavy",
                      env={**FAST_PDF, **(env or {})}).wait_ready(60)


def jobs_of(pg: psycopg.Connection, task: str) -> list[dict[str, Any]]:
    """The pgbroker job rows of a ticketflow task (short name), with their first argument as
    ``arg`` (the JSON body of a Celery protocol 2 message is ``[args, kwargs, embed]``)."""
    return rows(pg, "SELECT *, (convert_from(body, 'UTF8')::jsonb -> 0 ->> 0)::bigint AS arg"
                    " FROM pgbroker.jobs WHERE task = %s ORDER BY created_at, retries",
                f"ticketflow.tasks.{task}")


def held(session: Session, event_id: int, seats: int = 1, hold: float = 600) -> int:
    """A new held reservation (``hold`` seconds); returns its id."""
    return services.reserve(session, event_id, "fan@example.com", seats, hold_seconds=hold).id


def confirmed(session: Session, event_id: int, seats: int = 1) -> int:
    """A new confirmed reservation (its e-mail job enqueued); returns its id."""
    return services.confirm(session, held(session, event_id, seats)).id


def seats_taken(pg: psycopg.Connection, event_id: int) -> int:
    return pg.execute("SELECT seats_taken FROM ticketflow.events WHERE id = %s",
                      (event_id,)).fetchone()[0]
