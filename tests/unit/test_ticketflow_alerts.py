"""ticketflow's alert for a dead money job: logged at CRITICAL, from pgbroker's ``job_dead``
signal as pgbroker sends it (the alerts that write to the database:
tests/integration/test_ticketflow_alerts.py)."""

from __future__ import annotations

import logging
import uuid

import pytest

from pgbroker import signals
from ticketflow import alerts  # noqa: F401 - connects ticketflow's receivers to the signals


def test_a_dead_money_job_is_logged_critical(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ticketflow.alerts"):
        signals.send_job_dead([(uuid.uuid4(), "ticketflow.tasks.charge_payment",
                                "TransientPaymentError: gateway timeout", 1),
                               (uuid.uuid4(), "ticketflow.tasks.render_ticket_pdf", "x", 1)])
    [record] = [r for r in caplog.records if r.name == "ticketflow.alerts"]
    assert record.levelno == logging.CRITICAL
    assert "charge_payment" in record.getMessage() and "DEAD" in record.getMessage()
