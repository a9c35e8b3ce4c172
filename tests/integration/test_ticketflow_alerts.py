"""ticketflow's alerts from pgbroker's signals (issue 22): a paused task e-mails every owner
through ticketflow's own e-mail service and leaves a notice in the app (a dead money job logged
at CRITICAL needs no database: tests/unit/test_ticketflow_alerts.py). The signals are sent as
pgbroker sends them (``pgbroker.signals.send_*``)."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from pgbroker import signals
from pgbroker._pg.local_server import ENV_DATABASE_URL
from tests.support.db import rows
from ticketflow import alerts


def test_a_paused_task_emails_every_owner_and_leaves_a_notice(
        tf_url: str, pg: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DATABASE_URL, tf_url)
    monkeypatch.setenv(alerts.ENV_OWNERS, "ana@example.com, ben@example.com")
    job = uuid.uuid4()
    signals.send_task_paused("ticketflow.tasks.render_ticket_pdf",
                             "5 deliveries in a row lost their worker", [job], signals.SELF)
    emails = rows(pg, "SELECT reservation_id, kind, recipient, subject, body "
                      "FROM ticketflow.sent_emails ORDER BY recipient")
    assert [e["recipient"] for e in emails] == ["ana@example.com", "ben@example.com"]
    assert all(e["kind"] == "owner-notice" and e["reservation_id"] is None for e in emails)
    assert "render_ticket_pdf paused" in emails[0]["subject"]
    assert str(job) in emails[0]["body"] and "pgbroker task resume" in emails[0]["body"]
    notices = rows(pg, "SELECT owner, read_at FROM ticketflow.owner_notices ORDER BY owner")
    assert notices == [{"owner": "ana@example.com", "read_at": None},
                       {"owner": "ben@example.com", "read_at": None}]
