"""ticketflow: the reference application of pgbroker (ticket reservations that are confirmed,
paid and expire), and the demo a newcomer runs first (``python -m ticketflow demo``).

``ticketflow.app`` is the Celery app, so ``celery -A ticketflow worker`` and
``celery -A ticketflow beat`` work as with any Celery project. Its configuration is the module
``celeryconfig`` (``celeryconfig.py`` at the repository root; ``TICKETFLOW_CONFIG_MODULE`` names
another), loaded lazily the first time the configuration is read.

Modules: ``models`` (SQLAlchemy 2), ``db`` (engine, sessions, migrations), ``services`` (reserve,
confirm, pay, expire_reservations, ...), ``jobs`` (the jobs the services enqueue, by task name),
``tasks`` (the Celery tasks, which call the services), ``gateway`` (a fake payment gateway),
``schedule`` (the beat schedule), ``demo``.
"""

from __future__ import annotations

import os

from celery import Celery

import pgbroker  # noqa: F401 - registers the pgbroker:// transport with kombu

__all__ = ["app"]

app = Celery("ticketflow")
app.config_from_object(os.environ.get("TICKETFLOW_CONFIG_MODULE", "celeryconfig"))
