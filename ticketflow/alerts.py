"""ticketflow's alerts, from pgbroker's signals (connected when ``ticketflow.tasks`` is imported,
so in every worker: the signals fire in the worker or sweeper that made the change).

* ``task_paused``: pgbroker paused a task name whose deliveries kept killing their worker (or an
  operator paused one). Every owner of the deployment (``TICKETFLOW_OWNERS``, comma-separated)
  gets a notice in the app and an e-mail, through ticketflow's own e-mail service
  (:func:`ticketflow.services.notify_owners`).
* ``job_dead``: a money job (a charge) that ran out of attempts or failed for good is logged at
  CRITICAL -- seed 000's "money jobs that run out of attempts alert". Its payment is marked
  ``failed`` by the task itself (``tasks._PaymentTask.on_failure``).

Receivers run on the worker's event loop: each is one short transaction, and never raises (a
failure is logged; pgbroker's own CRITICAL line about the pause is there anyway).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pgbroker import signals

from . import db, services

__all__ = ["owners", "email_owners_of_pause", "alert_dead_money_job", "MONEY_TASKS",
           "ENV_OWNERS", "DEFAULT_OWNERS"]

logger = logging.getLogger(__name__)

#: The deployment's owners, comma-separated e-mail addresses.
ENV_OWNERS = "TICKETFLOW_OWNERS"
DEFAULT_OWNERS = "owners@ticketflow.example"

#: Tasks that move money: a dead one is an alert.
MONEY_TASKS = frozenset({"ticketflow.tasks.charge_payment"})


def owners() -> list[str]:
    return [o.strip() for o in (os.environ.get(ENV_OWNERS) or DEFAULT_OWNERS).split(",")
            if o.strip()]


@signals.task_paused.connect
def email_owners_of_pause(sender: Any = None, task: str = "", reason: str = "",
                          job_ids: Any = (), actor: str = "", **_: Any) -> None:
    jobs = ", ".join(map(str, job_ids)) or "none"
    body = (f"pgbroker paused the task {task}: {reason}.\n"
            f"Paused by: {actor}. Jobs that caused it: {jobs}.\n"
            f"No worker runs it until it is resumed: pgbroker task resume {task} --reason '...'"
            f" (or the admin page's Paused tasks).")
    try:
        with db.session() as session:
            services.notify_owners(session, owners(), f"[ticketflow] task {task} paused", body)
    except Exception:  # an alert must never break the worker that sends it
        logger.exception("could not notify the owners that task %s was paused", task)


@signals.job_dead.connect
def alert_dead_money_job(sender: Any = None, job_id: Any = None, task: str | None = None,
                         reason: str | None = None, attempts: int = 0, **_: Any) -> None:
    if task in MONEY_TASKS:
        logger.critical("money job %s (%s) is DEAD after %d attempt(s): %s -- see pgbroker dead "
                        "list", job_id, task, attempts, reason)
