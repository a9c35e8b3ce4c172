"""Celery configuration of ticketflow (``celery -A ticketflow worker``): production settings.

The database is ``PGBROKER_DATABASE_URL`` (``postgresql://user:password@host:port/db``), else
the local server ``postgresql://postgres@127.0.0.1:5432/postgres``. This module never starts an
embedded server: ``python -m ticketflow demo`` starts one when needed and hands its URL to the
worker and beat it runs, through that variable.
"""

from __future__ import annotations

import os

from pgbroker._pg.local_server import DEFAULT_LOCAL_URL, ENV_DATABASE_URL, normalize_url
from ticketflow.schedule import beat_schedule as _beat_schedule

# -- broker: the application's own PostgreSQL -----------------------------------------------------
broker_url = "pgbroker+" + normalize_url(os.environ.get(ENV_DATABASE_URL) or DEFAULT_LOCAL_URL)
broker_connection_retry_on_startup = True
broker_transport_options = {
    # Money tasks must carry an idempotency key: enqueueing a charge twice charges once.
    "require_idempotency_key": ["ticketflow.tasks.charge_payment"],
}

# ticketflow.alerts connects pgbroker's signals (a paused task e-mails the owners; a dead money
# job is logged at CRITICAL) in every worker
include = ["ticketflow.tasks", "ticketflow.alerts"]

# -- delivery: at least once, and nothing lost -----------------------------------------------------
# Ack after the task ran, so a worker that dies mid-task has its task redelivered (every
# ticketflow task is idempotent); a pool process killed under a task gives the message back too.
task_acks_late = True
task_reject_on_worker_lost = True
# A task that raised (or hit its time limit) is acked -- and pgbroker turns that ack of a final
# failure into a 'dead' job with the error and traceback: a dead letter, not a silent loss.
# (Celery 5.7 splits task_acks_on_failure_or_timeout, now deprecated, into these two; older
# versions ignore them and ack on failure and timeout by default, the same thing.)
task_acks_on_failure = True
task_acks_on_timeout = True
task_time_limit = 120
# One message at a time per pool process: long tasks never hold others hostage in a prefetch.
worker_prefetch_multiplier = 1
# pgbroker acks by (job, attempt) on any connection: a task outliving a lost connection still
# completes its own job, so there is no need to cancel it.
worker_cancel_long_running_tasks_on_connection_loss = False

# -- JSON only: no pickle from the queue -----------------------------------------------------------
accept_content = ["json"]
task_serializer = "json"
result_serializer = "json"
result_accept_content = ["json"]
task_ignore_result = True  # no result backend: the database rows are the results
result_expires = None  # ... so no daily celery.backend_cleanup entry in beat either

timezone = "UTC"
enable_utc = True

# -- queues ----------------------------------------------------------------------------------------
# Pools (seed 001): each task goes to the pool made for what it spends, one worker per pool
# (docker-compose.yml; the README's commands):
#   system  short sweeps and clean-ups      -Q system  -c 2
#   heavy   CPU- and memory-heavy work      -Q heavy   -c 2 --max-memory-per-child 262144
#           (one job per pool process at a time, prefetch 1; a process above the cap is
#           replaced after its job)
#   io      work that mostly waits on other systems (SMTP, the payment gateway): many at once
#                                           -Q default,email -c 16
# E-mails keep a queue of their own in the io pool: a burst of them never delays payments.
task_default_queue = "default"
task_routes = {
    "ticketflow.tasks.send_confirmation_email": {"queue": "email"},
    "ticketflow.tasks.charge_payment": {"queue": "default"},
    "ticketflow.tasks.expire_reservations": {"queue": "system"},
    "ticketflow.tasks.render_ticket_pdf": {"queue": "heavy"},
}

# -- beat: schedule state in PostgreSQL, each occurrence fired once however many beats run ---------
beat_scheduler = "pgbroker.beat:Scheduler"
beat_schedule = _beat_schedule()
